"""Depth pruning + distillation under DeepSpeed ZeRO-3.

The student keeps every other decoder layer of the teacher (28 -> 14 layers
for Llama-3.2-3B) and is initialised from the kept layers, then distilled
from the full teacher. Both models are created partitioned (zero.Init through
HfDeepSpeedConfig), so weights are only touched inside GatheredParameters.

    deepspeed --num_gpus 8 19_zero3_layer_drop_distill.py --data data/fineweb_edu_tok2k
"""
import argparse
import copy
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_from_disk
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="meta-llama/Llama-3.2-3B")
    ap.add_argument("--data", default="data/fineweb_edu_tok2k")
    ap.add_argument("--out", default="ckpt/llama32-3b-half-depth")
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--T", type=float, default=2.0)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--n_val", type=int, default=512)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def make_ds_config(args, world, train=True):
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_bs * args.accum * world,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10 ** 9,
    }
    if train:
        cfg["gradient_clipping"] = 1.0
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}}
        cfg["scheduler"] = {"type": "WarmupCosineLR",
                            "params": {"total_num_steps": args.steps, "warmup_num_steps": 200}}
    return cfg


@torch.no_grad()
def copy_gathered(dst_module, src_module, rank):
    """Copy src -> dst where both are ZeRO-3 partitioned; rank 0 writes, the result is re-partitioned."""
    dst, src = list(dst_module.parameters()), list(src_module.parameters())
    with deepspeed.zero.GatheredParameters(src, modifier_rank=None):
        with deepspeed.zero.GatheredParameters(dst, modifier_rank=0):
            if rank == 0:
                for d, s in zip(dst, src):
                    d.data.copy_(s.data)


def gathered_norm(param):
    # all ranks must enter: the gather is a collective
    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        return param.data.float().norm().item()


def main():
    args = parse()
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_cfg = make_ds_config(args, world, train=True)
    dschf = HfDeepSpeedConfig(train_cfg)  # must stay referenced while the models are built

    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.bfloat16)
    t_cfg = teacher.config
    keep = list(range(0, t_cfg.num_hidden_layers, 2))
    s_cfg = copy.deepcopy(t_cfg)
    s_cfg.num_hidden_layers = len(keep)
    student = AutoModelForCausalLM.from_config(s_cfg, torch_dtype=torch.bfloat16)

    copy_gathered(student.model.embed_tokens, teacher.model.embed_tokens, rank)
    copy_gathered(student.model.norm, teacher.model.norm, rank)
    for s_i, t_i in enumerate(keep):
        copy_gathered(student.model.layers[s_i], teacher.model.layers[t_i], rank)
    if not s_cfg.tie_word_embeddings:
        copy_gathered(student.lm_head, teacher.lm_head, rank)

    t_engine, _, _, _ = deepspeed.initialize(model=teacher, config=make_ds_config(args, world, train=False))
    t_engine.eval()
    engine, _, _, _ = deepspeed.initialize(model=student, model_parameters=student.parameters(), config=train_cfg)

    ds = load_from_disk(args.data).with_format("torch")
    val_ds = ds.select(range(args.n_val))
    train_ds = ds.select(range(args.n_val, len(ds)))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True)
    # ZeRO-3 forwards are collective, so every rank must see the same number of val batches
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_bs, sampler=val_sampler)

    emb_norm = gathered_norm(engine.module.model.embed_tokens.weight)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"student keeps layers {keep}; embed norm {emb_norm:.2f}; world {world}", flush=True)

    def kd_step(ids):
        with torch.no_grad():
            t_logits = t_engine(input_ids=ids).logits
        s_logits = engine(input_ids=ids).logits
        T = args.T
        kd = F.kl_div(F.log_softmax(s_logits[:, :-1].float() / T, -1).flatten(0, 1),
                      F.log_softmax(t_logits[:, :-1].float() / T, -1).flatten(0, 1),
                      log_target=True, reduction="batchmean") * T * T
        ce = F.cross_entropy(s_logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        return kd, ce

    step, epoch = 0, 0
    t0 = time.time()
    engine.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            boundary = engine.is_gradient_accumulation_boundary()
            kd, ce = kd_step(ids)
            loss = 0.5 * kd + 0.5 * ce
            engine.backward(loss)
            engine.step()
            if not boundary:
                continue
            step += 1

            if step % 20 == 0:
                stats = torch.stack([kd.detach(), ce.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} kd {stats[0]:.4f} ce {stats[1]:.4f} lr {engine.get_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.save_every == 0 or step == args.steps:
                engine.eval()
                tot = torch.zeros(3, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for vb in val_loader:
                        vkd, vce = kd_step(vb["input_ids"].to(device))
                        tot += torch.tensor([vkd.item(), vce.item(), 1.0], device=device, dtype=torch.float64)
                dist.all_reduce(tot)
                engine.train()
                # save_checkpoint / save_16bit_model are collective under ZeRO-3: all ranks call them
                engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step, "epoch": epoch})
                engine.save_16bit_model(os.path.join(args.out, f"hf_step{step}"))
                if rank == 0:
                    s_cfg.save_pretrained(os.path.join(args.out, f"hf_step{step}"))
                    print(f"[val] step {step} kd {tot[0] / tot[2]:.4f} ppl {math.exp(tot[1] / tot[2]):.2f}",
                          flush=True)
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
