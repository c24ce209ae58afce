#!/usr/bin/env python
"""GPT-2 (124M) pretraining on OpenWebText, nanoGPT style, DDP over several nodes.

Launch: one torchrun per node, torchrun starts one worker per GPU.

    #!/bin/bash
    #SBATCH --job-name=gpt2-124m
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=32
    #SBATCH --time=24:00:00

    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29500
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT \
        train_gpt2.py --data_dir /scratch/shared/owt --out_dir /scratch/shared/$USER/gpt2_124m

The same file can also be started directly with `srun python train_gpt2.py` and
4 tasks per node.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50304, ctx=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)),
                                                            targets.view(-1))
        return logits, loss


def dist_env():
    """Rank layout from Slurm when run under srun, otherwise from torchrun."""
    if "SLURM_PROCID" in os.environ:
        rank = int(os.environ["SLURM_PROCID"])
        world_size = int(os.environ["SLURM_NTASKS"])
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["SLURM_LOCALID"]))
    else:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    return rank, world_size, local_rank


def get_batch(data, block, bs, device, gen):
    ix = torch.randint(len(data) - block - 1, (bs,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--block_size", type=int, default=1024)
    ap.add_argument("--total_batch_tokens", type=int, default=524288)
    ap.add_argument("--max_iters", type=int, default=19073)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=715)
    ap.add_argument("--eval_interval", type=int, default=250)
    ap.add_argument("--eval_iters", type=int, default=50)
    args = ap.parse_args()

    rank, world_size, local_rank = dist_env()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = f"cuda:{local_rank}"
    master = rank == 0

    grad_accum = args.total_batch_tokens // (args.batch_size * args.block_size * world_size)
    assert grad_accum > 0
    gen = torch.Generator().manual_seed(1337 + rank)
    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")

    torch.manual_seed(1337)
    model = GPT().to(device)
    model = DDP(model, device_ids=[local_rank])
    raw = model.module
    decay = [p for p in raw.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    def lr_at(it):
        if it < args.warmup:
            return args.lr * (it + 1) / args.warmup
        r = (it - args.warmup) / (args.max_iters - args.warmup)
        return args.lr * 0.1 + 0.5 * args.lr * 0.9 * (1 + math.cos(math.pi * r))

    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    it0 = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        raw.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        it0 = ck["iter"] + 1
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world {world_size}, grad_accum {grad_accum}", flush=True)

    @torch.no_grad()
    def estimate_val_loss():
        model.eval()
        losses = torch.zeros(args.eval_iters, device=device)
        for k in range(args.eval_iters):
            x, y = get_batch(val_data, args.block_size, args.batch_size, device, gen)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = raw(x, y)
            losses[k] = loss
        model.train()
        out = losses.mean()
        dist.all_reduce(out, op=dist.ReduceOp.AVG)
        return out.item()

    t0 = time.time()
    for it in range(it0, args.max_iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        for micro in range(grad_accum):
            x, y = get_batch(train_data, args.block_size, args.batch_size, device, gen)
            sync = micro == grad_accum - 1
            with (nullcontext() if sync else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(x, y)
                (loss / grad_accum).backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if master and it % 10 == 0:
            dt = time.time() - t0
            t0 = time.time()
            print(f"iter {it} loss {loss.item():.4f} norm {norm:.2f} lr {lr_at(it):.2e} "
                  f"{dt * 100:.0f}ms/it", flush=True)
        if it % args.eval_interval == 0 or it == args.max_iters - 1:
            vl = estimate_val_loss()
            if master:
                print(f"iter {it} val loss {vl:.4f}", flush=True)
                torch.save({"model": raw.state_dict(), "opt": opt.state_dict(), "iter": it}, ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
