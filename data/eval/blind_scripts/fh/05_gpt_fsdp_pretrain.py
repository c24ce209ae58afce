#!/usr/bin/env python
"""Causal LM pretraining (GPT-2 XL sized) with FSDP on the A100 partition.

    #!/bin/bash
    #SBATCH --job-name=gpt-fsdp
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=64
    #SBATCH --time=48:00:00
    export HEAD=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    srun torchrun --nnodes $SLURM_NNODES --nproc_per_node 8 \
         --rdzv_id $SLURM_JOB_ID --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
         gpt_fsdp_pretrain.py --data /scratch/project_lm/tokens --out /scratch/project_lm/ckpt
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block


class TokenShards(Dataset):
    """Fixed-length windows over pre-tokenised uint16 .bin shards (memory mapped)."""

    def __init__(self, pattern, seq_len):
        self.seq_len = seq_len
        self.shards = [np.memmap(f, dtype=np.uint16, mode="r") for f in sorted(glob.glob(pattern))]
        counts = [(len(arr) - 1) // seq_len for arr in self.shards]
        self.offsets = np.cumsum([0] + counts)

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        off = (i - int(self.offsets[s])) * self.seq_len
        chunk = torch.from_numpy(self.shards[s][off:off + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--min-lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=500)
    return ap.parse_args()


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(ratio, 1.0)))


def save_checkpoint(model, optimizer, step, args, rank):
    path = os.path.join(args.out, f"step_{step:07d}.pt")
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            model_state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
        torch.save({"model": model_state, "optim": optim_state, "step": step}, path)
        print(f"saved {path}", flush=True)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, max_batches=50):
    model.eval()
    tot = torch.zeros(2, device="cuda")
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        out = model(input_ids=x, labels=y)
        tot[0] += out.loss.float()
        tot[1] += 1
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(1234)

    grad_accum = args.global_batch // (args.micro_batch * world)
    assert grad_accum * args.micro_batch * world == args.global_batch, "global batch not divisible"

    train_ds = TokenShards(os.path.join(args.data, "train_*.bin"), args.seq_len)
    val_ds = TokenShards(os.path.join(args.data, "val_*.bin"), args.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=val_sampler,
                            num_workers=2, drop_last=True)

    config = GPT2Config(n_positions=args.seq_len, n_embd=1600, n_layer=48, n_head=25,
                        vocab_size=50304, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    model = FSDP(model,
                 auto_wrap_policy=wrap,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=torch.cuda.current_device(),
                 limit_all_gathers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"~{n_params / 1e9:.2f}B params, world {world}, grad_accum {grad_accum}", flush=True)

    step, epoch = 0, 0
    sampler.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while step < args.max_steps:
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, args)
        loss_acc = torch.zeros((), device="cuda")
        for micro in range(grad_accum):
            try:
                x, y = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(loader)
                x, y = next(it)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            if micro < grad_accum - 1:
                with model.no_sync():
                    loss = model(input_ids=x, labels=y).loss / grad_accum
                    loss.backward()
            else:
                loss = model(input_ids=x, labels=y).loss / grad_accum
                loss.backward()
            loss_acc += loss.detach()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / 10
                tok_s = args.global_batch * args.seq_len / dt
                print(f"step {step} loss {loss_acc.item():.4f} lr {lr_at(step, args):.2e} "
                      f"{tok_s / 1e3:.1f}k tok/s", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0:
            val = evaluate(model, val_loader)
            if rank == 0:
                print(f"step {step} val_loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)
        if step % args.save_every == 0:
            save_checkpoint(model, optimizer, step, args, rank)

    save_checkpoint(model, optimizer, step, args, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
