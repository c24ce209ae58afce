"""
MambaByte: token-free Mamba LM on raw bytes (enwik8 / PG-19 bytes), 8192-byte windows.
Reports bits-per-byte on the validation split.

    torchrun --standalone --nproc_per_node=8 17_mambabyte_enwik8.py --data data/enwik8
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

from mamba_ssm.modules.mamba_simple import Mamba
from mamba_ssm.ops.triton.layer_norm import RMSNorm, layer_norm_fn


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/enwik8")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--d_model", type=int, default=1024)
    ap.add_argument("--n_layer", type=int, default=40)
    ap.add_argument("--d_state", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--min_lr", type=float, default=4e-5)
    ap.add_argument("--warmup_iters", type=int, default=1000)
    ap.add_argument("--max_iters", type=int, default=80000)
    ap.add_argument("--eval_interval", type=int, default=2000)
    ap.add_argument("--eval_iters", type=int, default=100)
    ap.add_argument("--out_dir", default="out/mambabyte")
    return ap.parse_args()


class MambaByte(nn.Module):
    def __init__(self, d_model, n_layer, d_state):
        super().__init__()
        self.embedding = nn.Embedding(256, d_model)
        self.mixers = nn.ModuleList([Mamba(d_model, d_state=d_state, d_conv=4, expand=2, layer_idx=i)
                                     for i in range(n_layer)])
        self.norms = nn.ModuleList([RMSNorm(d_model, eps=1e-5) for _ in range(n_layer)])
        self.norm_f = RMSNorm(d_model, eps=1e-5)
        self.lm_head = nn.Linear(d_model, 256, bias=False)
        self.lm_head.weight = self.embedding.weight
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight"):
                nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                with torch.no_grad():
                    p /= math.sqrt(n_layer)

    def forward(self, idx):
        hidden = self.embedding(idx)
        residual = None
        for mixer, norm in zip(self.mixers, self.norms):
            hidden, residual = layer_norm_fn(hidden, norm.weight, norm.bias, residual=residual,
                                             prenorm=True, residual_in_fp32=True, eps=norm.eps,
                                             is_rms_norm=True)
            hidden = mixer(hidden)
        hidden = layer_norm_fn(hidden, self.norm_f.weight, self.norm_f.bias, residual=residual,
                               prenorm=False, residual_in_fp32=True, eps=self.norm_f.eps,
                               is_rms_norm=True)
        return self.lm_head(hidden)


def get_batch(data, ctx, bs, gen, device):
    ix = torch.randint(len(data) - ctx - 1, (bs,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + ctx].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + ctx].astype(np.int64)) for i in ix])
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def estimate_bpb(model, data, args, gen, device="cuda:0"):
    model.eval()
    losses = torch.zeros(args.eval_iters, device=device)
    for k in range(args.eval_iters):
        x, y = get_batch(data, args.ctx, args.batch_size, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        losses[k] = F.cross_entropy(logits.float().view(-1, 256), y.view(-1))
    model.train()
    mean = losses.mean()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return mean.item() / math.log(2)


def get_lr(it, args):
    if it < args.warmup_iters:
        return args.lr * (it + 1) / args.warmup_iters
    ratio = min(1.0, (it - args.warmup_iters) / (args.max_iters - args.warmup_iters))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    master = rank == 0
    torch.manual_seed(1337 + rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    # enwik8 split 90M / 5M / 5M bytes
    raw = np.memmap(os.path.join(args.data, "enwik8"), dtype=np.uint8, mode="r")
    train_data, val_data = raw[:90_000_000], raw[90_000_000:95_000_000]
    train_gen = torch.Generator().manual_seed(1000 + rank)
    val_gen = torch.Generator().manual_seed(2000 + rank)

    torch.manual_seed(1337)
    model = MambaByte(args.d_model, args.n_layer, args.d_state).to(device)
    model = DDP(model, device_ids=[local_rank])
    raw_model = model.module
    decay = [p for n, p in raw_model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in raw_model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)

    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.1f}M params, "
              f"{args.batch_size * args.grad_accum * world * args.ctx} bytes/iter")

    best_bpb = float("inf")
    x, y = get_batch(train_data, args.ctx, args.batch_size, train_gen, device)
    t0 = time.time()
    for it in range(args.max_iters + 1):
        lr = get_lr(it, args)
        for g in opt.param_groups:
            g["lr"] = lr

        if it % args.eval_interval == 0 and it > 0:
            bpb = estimate_bpb(raw_model, val_data, args, val_gen)
            if master:
                print(f"iter {it}: val bpb {bpb:.4f}", flush=True)
                if bpb < best_bpb:
                    best_bpb = bpb
                    torch.save({"model": raw_model.state_dict(), "opt": opt.state_dict(),
                                "iter": it, "best_bpb": bpb, "args": vars(args)},
                               os.path.join(args.out_dir, "ckpt.pt"))
        if it == args.max_iters:
            break

        for micro in range(args.grad_accum):
            ctx = model.no_sync() if micro < args.grad_accum - 1 else nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, 256), y.view(-1)) / args.grad_accum
                x, y = get_batch(train_data, args.ctx, args.batch_size, train_gen, device)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

        if it % 50 == 0:
            lossf = loss.detach() * args.grad_accum
            dist.all_reduce(lossf, op=dist.ReduceOp.AVG)
            if master:
                dt = time.time() - t0
                print(f"iter {it}: loss {lossf.item():.4f} bpb {lossf.item() / math.log(2):.3f} "
                      f"lr {lr:.2e} {dt * 1000 / 50:.0f}ms/iter", flush=True)
            t0 = time.time()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
