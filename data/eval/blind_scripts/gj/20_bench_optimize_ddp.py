#!/usr/bin/env python3
"""Does DDPOptimizer pay off? Time-boxed training benchmark of compiled DDP variants.

Compares, on the same Llama-ish model:
  eager            plain DDP
  compile          torch.compile(DDP) with optimize_ddp=True (graph split at bucket boundaries)
  compile-nosplit  torch.compile(DDP) with optimize_ddp=False (one graph, all-reduce after backward)
  compile-inner    DDP(torch.compile(model))

Each variant trains for a fixed wall-clock budget after warm-up and reports
steps/s and tokens/s aggregated over all ranks.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        bench_optimize_ddp.py --seconds 60 --bucket-cap-mb 25
"""
import argparse
import os
import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VARIANTS = ("eager", "compile", "compile-nosplit", "compile-inner")


class SwiGLUBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.n1 = nn.RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.n2 = nn.RMSNorm(d)
        f = 256 * ((8 * d // 3 + 255) // 256)
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, C // self.h).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, C))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, vocab, d, h, layers):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([SwiGLUBlock(d, h) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--seconds", type=float, default=60.0, help="timed budget per variant")
    p.add_argument("--bucket-cap-mb", type=int, default=25)
    return p.parse_args()


def make_model(variant, args, local_rank):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Model(args.vocab, args.dim, args.heads, args.layers).cuda()
    params = list(m.parameters())
    if variant == "eager":
        return DDP(m, device_ids=[local_rank], bucket_cap_mb=args.bucket_cap_mb), params
    if variant == "compile-inner":
        return DDP(torch.compile(m), device_ids=[local_rank], bucket_cap_mb=args.bucket_cap_mb), params
    torch._dynamo.config.optimize_ddp = variant == "compile"
    ddp = DDP(m, device_ids=[local_rank], bucket_cap_mb=args.bucket_cap_mb)
    return torch.compile(ddp), params


def train_step(model, opt, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def bench(variant, args, rank, world, local_rank):
    model, params = make_model(variant, args, local_rank)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=gen)
    y = torch.roll(x, -1, dims=1)

    t_first = time.perf_counter()
    for _ in range(args.warmup_steps):
        train_step(model, opt, x, y)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t_first
    torch.cuda.reset_peak_memory_stats()
    dist.barrier()

    steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        train_step(model, opt, x, y)
        steps += 1
        if steps % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    stats = torch.tensor([steps / elapsed, steps * args.batch * args.seq / elapsed, warmup_s,
                          torch.cuda.max_memory_allocated() / 2**30], device="cuda", dtype=torch.float64)
    mins, maxs, sums = stats.clone(), stats.clone(), stats.clone()
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    dist.all_reduce(maxs, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    del model, opt, params
    torch.cuda.empty_cache()
    return mins.tolist(), maxs.tolist(), sums.tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True

    if rank == 0:
        with torch.device("meta"):
            n = sum(p.numel() for p in Model(args.vocab, args.dim, args.heads, args.layers).parameters())
        print(f"world={world} params={n / 1e6:.0f}M seq={args.seq} batch/gpu={args.batch} "
              f"bucket_cap={args.bucket_cap_mb}MB", flush=True)
        print(f"{'variant':>16} | {'steps/s':>8} | {'tok/s total':>12} | {'warmup s':>8} | {'peak GiB':>8}", flush=True)

    for variant in args.variants:
        mins, maxs, sums = bench(variant, args, rank, world, local_rank)
        if rank == 0:
            print(f"{variant:>16} | {sums[0] / world:8.3f} | {sums[1]:12,.0f} | {maxs[2]:8.1f} | {maxs[3]:8.2f}"
                  f"   (steps/s per rank {mins[0]:.3f}..{maxs[0]:.3f})", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
