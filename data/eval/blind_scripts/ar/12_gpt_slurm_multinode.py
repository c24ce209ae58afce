#!/usr/bin/env python
"""Multi-node GPT pretraining, launched directly by Slurm (one task per GPU).

sbatch script:
    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=8
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=10
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29500
    srun python 12_gpt_slurm_multinode.py --data /lustre/tok/redpajama_gpt2 --out /lustre/ckpt/gpt-1b
"""
import argparse
import math
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def dist_env():
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", 0)))
    world = int(os.environ.get("SLURM_NTASKS", os.environ.get("WORLD_SIZE", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return rank, world, local_rank


class GPTBlock(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(C, dim=-1)
        q, k, v = [t.view(B, T, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, d, nh, nl):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([GPTBlock(d, nh) for _ in range(nl)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--d_model", type=int, default=2048)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--n_layer", type=int, default=20)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=80000)
    ap.add_argument("--ckpt_every", type=int, default=1000)
    ap.add_argument("--peak_tflops", type=float, default=312.0)
    args = ap.parse_args()

    rank, world, local_rank = dist_env()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(minutes=30))
    device = torch.device("cuda", local_rank)
    is_master = rank == 0
    if is_master:
        print(f"job {os.environ.get('SLURM_JOB_ID')} world={world} nodes={os.environ.get('SLURM_NNODES')}")

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    rng = np.random.default_rng(1000 + rank)

    def batch():
        ix = rng.integers(0, len(train) - args.ctx - 1, size=args.micro_bs)
        buf = np.stack([train[i:i + args.ctx + 1] for i in ix]).astype(np.int64)
        t = torch.from_numpy(buf).pin_memory().to(device, non_blocking=True)
        return t[:, :-1], t[:, 1:]

    torch.manual_seed(0)
    model = GPT(50304, args.ctx, args.d_model, args.n_head, args.n_layer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model = DDP(model, device_ids=[local_rank], bucket_cap_mb=100)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    start = 0
    ckpt_file = os.path.join(args.out, "latest.pt")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["step"]
        rng = np.random.default_rng(1000 + rank + start)
        del ck

    tokens_per_step = args.micro_bs * args.accum * args.ctx * world
    flops_per_step = 6 * n_params * tokens_per_step
    if is_master:
        os.makedirs(args.out, exist_ok=True)
        print(f"{n_params / 1e9:.2f}B params, {tokens_per_step:,} tokens/step, resuming at {start}")

    t0 = time.time()
    for step in range(start, args.steps):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        for m in range(args.accum):
            x, y = batch()
            model.require_backward_grad_sync = m == args.accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if (step + 1) % 10 == 0:
            l = loss.detach() * args.accum
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            torch.cuda.synchronize()
            dt = (time.time() - t0) / 10
            t0 = time.time()
            if is_master:
                mfu = flops_per_step / dt / (args.peak_tflops * 1e12 * world)
                print(f"step {step + 1} loss {l.item():.4f} lr {lr:.2e} "
                      f"{tokens_per_step / dt / 1e6:.2f}M tok/s mfu {mfu:.1%}", flush=True)

        if (step + 1) % args.ckpt_every == 0:
            if is_master:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                           ckpt_file + ".tmp")
                os.replace(ckpt_file + ".tmp", ckpt_file)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
