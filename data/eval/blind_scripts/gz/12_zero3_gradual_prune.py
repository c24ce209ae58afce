"""Gradual structured pruning of MLP channels during fine-tuning (DeepSpeed ZeRO-3).

Every `--prune_every` steps between `--prune_start` and `--prune_end` the MLP
channels with the smallest joint L2 norm of (gate row, up row, down column)
are masked; the target sparsity follows the cubic schedule of Zhu & Gupta
(2017). Masked channels are kept at zero after every optimizer step, so at the
end they can be sliced away.

deepspeed --num_gpus 8 12_zero3_gradual_prune.py --model meta-llama/Llama-2-7b-hf --final_sparsity 0.5
"""
import argparse
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator
from transformers.integrations import HfDeepSpeedConfig


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--dataset", default="Open-Orca/SlimOrca-Dedup")
    ap.add_argument("--out", default="ckpt/llama2-7b-gp50")
    ap.add_argument("--seq_len", type=int, default=1024)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--total_steps", type=int, default=6000)
    ap.add_argument("--final_sparsity", type=float, default=0.5)
    ap.add_argument("--prune_start", type=int, default=200)
    ap.add_argument("--prune_end", type=int, default=4000)
    ap.add_argument("--prune_every", type=int, default=100)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def ds_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.total_steps, "warmup_num_steps": 100}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 5e7,
        },
        "steps_per_print": 100000,
    }


def cubic_sparsity(step, args):
    if step < args.prune_start:
        return 0.0
    t = min(1.0, (step - args.prune_start) / (args.prune_end - args.prune_start))
    return args.final_sparsity * (1 - (1 - t) ** 3)


def build_data(tok, args):
    raw = load_dataset(args.dataset, split="train")

    def fmt(ex):
        text = ""
        for turn in ex["conversations"]:
            text += f"<|{turn['from']}|>\n{turn['value']}\n"
        enc = tok(text + tok.eos_token, truncation=True, max_length=args.seq_len, padding="max_length")
        enc["labels"] = [t if m else -100 for t, m in zip(enc["input_ids"], enc["attention_mask"])]
        return enc

    return raw.map(fmt, remove_columns=raw.column_names, num_proc=16).with_format("torch")


@torch.no_grad()
def compute_masks(model, sparsity):
    masks = []
    for layer in model.model.layers:
        mlp = layer.mlp
        score = (mlp.gate_proj.weight.data.float().norm(dim=1) ** 2
                 + mlp.up_proj.weight.data.float().norm(dim=1) ** 2
                 + mlp.down_proj.weight.data.float().norm(dim=0) ** 2)
        n_prune = int(sparsity * score.numel())
        mask = torch.ones_like(score, dtype=torch.bool)
        if n_prune > 0:
            mask[score.topk(n_prune, largest=False).indices] = False
        masks.append(mask)
    return masks


@torch.no_grad()
def apply_masks(model, masks):
    for layer, m in zip(model.model.layers, masks):
        mlp = layer.mlp
        mlp.gate_proj.weight.data.mul_(m.unsqueeze(1).to(mlp.gate_proj.weight.dtype))
        mlp.up_proj.weight.data.mul_(m.unsqueeze(1).to(mlp.up_proj.weight.dtype))
        mlp.down_proj.weight.data.mul_(m.unsqueeze(0).to(mlp.down_proj.weight.dtype))


def main():
    args = parse()
    deepspeed.init_distributed()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cfg = ds_config(args, world)
    dschf = HfDeepSpeedConfig(cfg)  # keep alive: makes from_pretrained load straight into ZeRO-3 shards

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token
    if rank != 0:
        dist.barrier()
    train_ds = build_data(tok, args)
    if rank == 0:
        dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler,
                        collate_fn=default_data_collator, num_workers=4, pin_memory=True)

    masks, cur_sparsity = None, 0.0
    step, epoch = 0, 0
    t0 = time.time()
    engine.train()
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            boundary = engine.is_gradient_accumulation_boundary()
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if not boundary:
                continue
            step += 1

            target = cubic_sparsity(step, args)
            if step % args.prune_every == 0 and target > cur_sparsity:
                masks = compute_masks(engine.module, target)
                cur_sparsity = target
                if rank == 0:
                    print(f"step {step}: pruning MLP channels to sparsity {target:.3f}", flush=True)
            if masks is not None:
                apply_masks(engine.module, masks)

            if step % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} sparsity {cur_sparsity:.3f} "
                          f"lr {engine.get_lr()[0]:.2e} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.save_every == 0 or step == args.total_steps:
                engine.save_checkpoint(args.out, tag=f"step{step}",
                                       client_state={"step": step, "sparsity": cur_sparsity})
                if rank == 0 and masks is not None:
                    torch.save([m.cpu() for m in masks], os.path.join(args.out, f"step{step}", "mlp_masks.pt"))
            if step >= args.total_steps:
                break
        epoch += 1

    engine.save_16bit_model(os.path.join(args.out, "final"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "final"))
        with open(os.path.join(args.out, "final", "pruning.json"), "w") as f:
            json.dump({"final_sparsity": cur_sparsity, "schedule": "cubic"}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
