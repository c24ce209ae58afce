#!/usr/bin/env python3
"""Throughput benchmark: eager vs. torch.compile modes for a GPT block stack under DDP.

Runs the same synthetic workload for every requested mode and prints a table of
tokens/s per rank plus the aggregate, so we can see whether compile still wins
once gradient all-reduce is in the picture.

Example:
    torchrun --standalone --nproc_per_node=8 bench_compile_modes.py \
        --modes eager default max-autotune-no-cudagraphs --seq-len 2048 --batch 8
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch._dynamo
from torch.nn.parallel import DistributedDataParallel as DDP


class CausalSelfAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.h, C // self.h).transpose(1, 2)
        k = k.view(B, T, self.h, C // self.h).transpose(1, 2)
        v = v.view(B, T, self.h, C // self.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, h)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, d, h, n_layer, max_len):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--modes", nargs="+", default=["eager", "default", "max-autotune-no-cudagraphs"])
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="per-GPU batch")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def build(args, mode, device):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.n_head, args.n_layer, args.seq_len).to(device)
    ddp = DDP(model, device_ids=[device.index], gradient_as_bucket_view=True)
    if mode == "eager":
        return model, ddp
    # DDPOptimizer splits the graph at bucket boundaries so all-reduce overlaps backward
    torch._dynamo.config.optimize_ddp = True
    return model, torch.compile(ddp, mode=mode)


def run_mode(args, mode, device, rank, world):
    torch._dynamo.reset()
    raw, model = build(args, mode, device)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-4, fused=True)
    amp_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    g = torch.Generator(device=device)
    g.manual_seed(1000 + rank)

    def step():
        idx = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=device, generator=g)
        x, y = idx[:, :-1], idx[:, 1:]
        with torch.autocast("cuda", dtype=amp_dtype, enabled=args.dtype == "bf16"):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_compile = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t_compile = time.perf_counter() - t_compile
    dist.barrier()

    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    elapsed_s = start.elapsed_time(end) / 1000.0

    tokens_per_s = args.iters * args.batch * args.seq_len / elapsed_s
    step_ms = 1000.0 * elapsed_s / args.iters
    peak_gb = torch.cuda.max_memory_allocated(device) / 2**30

    stats = torch.tensor([tokens_per_s, step_ms, peak_gb, t_compile], dtype=torch.float64)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)

    del model, raw, opt
    torch.cuda.empty_cache()
    return torch.stack(gathered).cpu(), loss.item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    results = {}
    for mode in args.modes:
        per_rank, last_loss = run_mode(args, mode, device, rank, world)
        results[mode] = per_rank
        if rank == 0:
            tps = per_rank[:, 0]
            print(
                f"[{mode:>28s}] total {tps.sum().item():>12,.0f} tok/s | "
                f"per-rank min {tps.min().item():,.0f} max {tps.max().item():,.0f} | "
                f"step {per_rank[:, 1].mean().item():.1f} ms | peak {per_rank[:, 2].max().item():.1f} GiB | "
                f"warmup+compile {per_rank[:, 3].max().item():.0f} s | loss {last_loss:.3f}",
                flush=True,
            )

    if rank == 0 and args.json_out:
        out = {
            "world_size": world,
            "config": vars(args),
            "results": {m: r.tolist() for m, r in results.items()},
            "gpu": torch.cuda.get_device_name(device),
        }
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
