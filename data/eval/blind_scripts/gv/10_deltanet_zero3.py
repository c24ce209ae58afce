"""
DeltaNet (fla) 1.3B pretraining with DeepSpeed ZeRO-3 on 8k packed sequences.

    deepspeed --num_gpus 8 10_deltanet_zero3.py --data_dir /data/fineweb_edu_packed_8k
"""
import argparse
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from fla.models import DeltaNetConfig, DeltaNetForCausalLM


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="checkpoints/deltanet_1.3b")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--total_steps", type=int, default=40000)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--eval_batches", type=int, default=40)
    p.add_argument("--save_every", type=int, default=5000)
    p.add_argument("--resume_tag", default=None)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return p.parse_args()


def build_ds_config(args, world_size):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": args.total_steps, "warmup_num_steps": args.warmup,
                       "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1},
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch], dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@torch.no_grad()
def evaluate(engine, loader, n_batches):
    engine.eval()
    tot = torch.zeros(2, device=engine.device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if i >= n_batches:
            break
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**batch).loss
        tot[0] += loss.double() * batch["input_ids"].size(0)
        tot[1] += batch["input_ids"].size(0)
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = build_ds_config(args, world)

    model_cfg = DeltaNetConfig(hidden_size=2048, num_hidden_layers=24, num_heads=16,
                               vocab_size=32000, attn_mode="chunk", use_short_conv=True,
                               fuse_cross_entropy=True, use_cache=False)
    # parameters are partitioned as they are created, so no rank ever holds the full model
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = DeltaNetForCausalLM(model_cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    if args.resume_tag:
        _, client_state = engine.load_checkpoint(args.out_dir, tag=args.resume_tag)
        start_step = client_state["step"]
    else:
        start_step = 0

    ds = load_from_disk(args.data_dir)
    train_sampler = DistributedSampler(ds["train"], num_replicas=world, rank=rank, shuffle=True,
                                       seed=2024, drop_last=True)
    val_sampler = DistributedSampler(ds["validation"], num_replicas=world, rank=rank,
                                     shuffle=False, drop_last=True)
    train_loader = DataLoader(ds["train"], batch_size=args.micro_batch, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(ds["validation"], batch_size=args.micro_batch, sampler=val_sampler,
                            collate_fn=collate, num_workers=2)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"params {n_params / 1e9:.2f}B | world {world} | global batch {ds_config['train_batch_size']}")
        with open(os.path.join(args.out_dir, "ds_config.json"), "w") as f:
            json.dump(ds_config, f, indent=2)

    step = start_step
    micro_per_epoch = len(train_loader)
    epoch = (step * args.grad_accum) // micro_per_epoch
    skip = (step * args.grad_accum) % micro_per_epoch
    t0 = time.time()
    while step < args.total_steps:
        train_sampler.set_epoch(epoch)
        for i, batch in enumerate(train_loader):
            if skip:
                skip -= 1
                continue
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            boundary = engine.is_gradient_accumulation_boundary()
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if not boundary:
                continue
            step += 1

            if step % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {engine.get_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val = evaluate(engine, val_loader, args.eval_batches)
                if rank == 0:
                    print(f"step {step} val_loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)

            if step % args.save_every == 0:
                # collective: every rank writes its own ZeRO partition
                engine.save_checkpoint(args.out_dir, tag=f"step{step}", client_state={"step": step})

            if step >= args.total_steps:
                break
        epoch += 1

    # embedding norm for the run log; the weight is partitioned, gather it on all ranks first
    emb = engine.module.get_input_embeddings().weight
    with deepspeed.zero.GatheredParameters(emb, modifier_rank=None):
        emb_norm = emb.float().norm(dim=-1).mean().item()
    engine.save_checkpoint(args.out_dir, tag="final", client_state={"step": step})
    engine.save_16bit_model(os.path.join(args.out_dir, "hf_final"), "pytorch_model.bin")
    if rank == 0:
        print(f"done. mean embedding row norm {emb_norm:.3f}")
        model_cfg.save_pretrained(os.path.join(args.out_dir, "hf_final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
