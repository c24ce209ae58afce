#!/usr/bin/env python
"""Llama-style decoder pretraining (RMSNorm / RoPE / SwiGLU) on packed uint32 token shards.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    03_llama350m_pile.py --config configs/llama_350m.yaml
"""
import os
import math
import time
import glob
import argparse
import logging

import yaml
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("pretrain")

DEFAULTS = dict(
    data_glob="/mnt/shared/tokens/pile_*.bin", val_path="/mnt/shared/tokens/val.bin",
    out_dir="/mnt/shared/ckpt/llama350m", dim=1024, n_layers=24, n_heads=16, vocab_size=32000,
    seq_len=2048, micro_bs=8, grad_accum=4, lr=3e-4, min_lr=3e-5, warmup=2000, max_steps=100000,
    wd=0.1, clip=1.0, eval_every=1000, eval_batches=40, log_every=20, ckpt_every=2000, eos_id=2,
)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def rope_cache(seq_len, head_dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(seq_len).float()
    freqs = torch.outer(t, inv)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = cos[: x.size(-2)], sin[: x.size(-2)]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.hd = n_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.n_heads, self.hd).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        hidden = int(8 * dim / 3 / 64 + 1) * 64
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn, self.ffn = Attention(dim, n_heads), FeedForward(dim)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab_size"], c["dim"])
        self.layers = nn.ModuleList(Layer(c["dim"], c["n_heads"]) for _ in range(c["n_layers"]))
        self.norm = RMSNorm(c["dim"])
        self.output = nn.Linear(c["dim"], c["vocab_size"], bias=False)
        cos, sin = rope_cache(c["seq_len"], c["dim"] // c["n_heads"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c["n_layers"]) if n.endswith(("wo.weight", "w2.weight")) else 0.02)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        return self.output(self.norm(h))


class ShardSampler:
    """Random windows over a list of memory-mapped uint32 shards."""

    def __init__(self, paths, seq_len, micro_bs, seed, eos_id):
        self.shards = [np.memmap(p, dtype=np.uint32, mode="r") for p in sorted(paths)]
        self.sizes = np.array([len(s) for s in self.shards], dtype=np.float64)
        self.rng = np.random.default_rng(seed)
        self.seq_len, self.bs, self.eos_id = seq_len, micro_bs, eos_id

    def batch(self):
        out = np.empty((self.bs, self.seq_len + 1), dtype=np.int64)
        which = self.rng.choice(len(self.shards), size=self.bs, p=self.sizes / self.sizes.sum())
        for i, s in enumerate(which):
            start = self.rng.integers(0, len(self.shards[s]) - self.seq_len - 1)
            out[i] = self.shards[s][start:start + self.seq_len + 1]
        x = torch.from_numpy(out[:, :-1])
        y = torch.from_numpy(out[:, 1:]).clone()
        # do not predict across the first document boundary of a window
        y[x == self.eos_id] = -100
        return x, y


def lr_lambda(step, c):
    if step < c["warmup"]:
        return c["lr"] * step / c["warmup"]
    p = min(1.0, (step - c["warmup"]) / (c["max_steps"] - c["warmup"]))
    return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1 + math.cos(math.pi * p))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    c = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            c.update(yaml.safe_load(f) or {})

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")

    torch.manual_seed(0)
    model = Llama(c).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.95), weight_decay=c["wd"], fused=True)
    step = 0
    if a.resume:
        sd = torch.load(a.resume, map_location="cpu")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step = sd["step"]
    n_params = sum(p.numel() for p in model.parameters())
    model = DDP(torch.compile(model), device_ids=[local_rank], gradient_as_bucket_view=True)

    train = ShardSampler(glob.glob(c["data_glob"]), c["seq_len"], c["micro_bs"], seed=1234 + 97 * rank + step, eos_id=c["eos_id"])
    log.info("params %.1fM, world %d, tokens/step %d", n_params / 1e6, world,
             world * c["micro_bs"] * c["grad_accum"] * c["seq_len"])

    @torch.no_grad()
    def evaluate():
        model.eval()
        val = ShardSampler([c["val_path"]], c["seq_len"], c["micro_bs"], seed=4321 + rank, eos_id=c["eos_id"])
        stats = torch.zeros(2, device=dev)
        for _ in range(c["eval_batches"]):
            x, y = val.batch()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            stats[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                        ignore_index=-100, reduction="sum")
            stats[1] += (y != -100).sum()
        dist.all_reduce(stats)
        model.train()
        return (stats[0] / stats[1]).item()

    tokens_since_log, loss_since_log = 0, 0.0
    t0 = time.time()
    while step < c["max_steps"]:
        for g in opt.param_groups:
            g["lr"] = lr_lambda(step, c)
        for micro in range(c["grad_accum"]):
            x, y = train.batch()
            x, y = x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
            model.require_backward_grad_sync = micro == c["grad_accum"] - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)
            (loss / c["grad_accum"]).backward()
            loss_since_log += loss.item() / c["grad_accum"]
            tokens_since_log += int((y != -100).sum())
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), c["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % c["log_every"] == 0:
            totals = torch.tensor([tokens_since_log, loss_since_log / c["log_every"]], dtype=torch.float64)
            dist.all_reduce(totals)
            dt = time.time() - t0
            tok_s = totals[0].item() / dt
            mfu = 6 * n_params * tok_s / (world * 989e12)
            log.info("step %d loss %.4f lr %.2e gnorm %.2f tok/s %.0f (%.0f/gpu) mfu %.1f%%",
                     step, totals[1].item() / world, opt.param_groups[0]["lr"], gnorm.item(),
                     tok_s, tok_s / world, 100 * mfu)
            tokens_since_log, loss_since_log = 0, 0.0
            t0 = time.time()

        if step % c["eval_every"] == 0:
            log.info("step %d val loss %.4f", step, evaluate())

        if step % c["ckpt_every"] == 0:
            if rank == 0:
                os.makedirs(c["out_dir"], exist_ok=True)
                torch.save({"model": model.module._orig_mod.state_dict(), "opt": opt.state_dict(),
                            "step": step, "config": c}, os.path.join(c["out_dir"], f"step{step:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
