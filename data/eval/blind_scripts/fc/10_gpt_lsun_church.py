"""Unconditional raster-order transformer prior over VQGAN f16 tokens for LSUN churches / bedrooms.

LSUN has no official held-out split for these categories, so 2% of the tokenized images are
kept aside for validation NLL (bits/dim-style reporting in nats per token).

    torchrun --nproc_per_node=8 10_gpt_lsun_church.py --tokens /data/tokens/lsun_church_f16.pt \
        --out runs/church_gpt_m --batch_size 24 --n_layer 24 --n_embd 1024
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class TokenFile(Dataset):
    """A single tensor (N, 256) of int16 code indices written by tokenize_lsun.py."""

    def __init__(self, path):
        blob = torch.load(path, map_location="cpu")
        self.codes = blob["codes"]
        self.codebook_size = blob["codebook_size"]
        self.grid = blob["grid"]

    def __len__(self):
        return self.codes.shape[0]

    def __getitem__(self, i):
        return self.codes[i].long()


class Block(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d), nn.Dropout(p))

    def forward(self, x, mask):
        h = self.n1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)[0]
        return x + self.ff(self.n2(x))


class TokenGPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_head, n_embd, pdrop=0.0):
        super().__init__()
        self.sos = vocab  # start token
        self.wte = nn.Embedding(vocab + 1, n_embd)
        self.wpe = nn.Parameter(torch.zeros(1, block_size, n_embd))
        self.blocks = nn.ModuleList([Block(n_embd, n_head, pdrop) for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((block_size, block_size), float("-inf")), 1),
                             persistent=False)

    def forward(self, codes):
        b, t = codes.shape
        inp = torch.cat([torch.full((b, 1), self.sos, device=codes.device, dtype=codes.dtype), codes[:, :-1]], 1)
        x = self.wte(inp) + self.wpe[:, :t]
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        return self.head(self.ln(x))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for codes in loader:
        codes = codes.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(codes)
        nll = F.cross_entropy(logits.float().flatten(0, 1), codes.flatten(), reduction="sum")
        tot[0] += nll.double()
        tot[1] += codes.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--n_layer", type=int, default=24)
    ap.add_argument("--n_head", type=int, default=16)
    ap.add_argument("--n_embd", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min_lr", type=float, default=3e-5)
    ap.add_argument("--warmup_iters", type=int, default=2000)
    ap.add_argument("--max_iters", type=int, default=400_000)
    ap.add_argument("--eval_interval", type=int, default=5000)
    ap.add_argument("--val_frac", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    full = TokenFile(args.tokens)
    n_val = int(len(full) * args.val_frac)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size * 2, sampler=val_sampler, num_workers=2)

    block = full.grid[0] * full.grid[1]
    model = TokenGPT(full.codebook_size, block, args.n_layer, args.n_head, args.n_embd, pdrop=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def lr_at(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / args.warmup_iters
        r = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
        return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(r, 1.0))) * (args.lr - args.min_lr)

    writer = SummaryWriter(args.out) if rank == 0 else None
    it, epoch, best = 0, 0, float("inf")
    t0 = time.time()
    while it < args.max_iters:
        train_sampler.set_epoch(epoch)
        for codes in train_dl:
            codes = codes.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = lr_at(it)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(codes)
            loss = F.cross_entropy(logits.float().flatten(0, 1), codes.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            it += 1

            if it % 100 == 0:
                lv = loss.detach().clone()
                dist.all_reduce(lv, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", lv.item(), it)
                    writer.add_scalar("train/lr", lr_at(it), it)
                    print(f"it {it} loss {lv.item():.4f} ({(time.time() - t0) * 10:.0f} ms/it)", flush=True)
                t0 = time.time()

            if it % args.eval_interval == 0:
                val = evaluate(model, val_dl, device)
                if rank == 0:
                    writer.add_scalar("val/nll", val, it)
                    print(f"it {it} val nll/token {val:.4f}", flush=True)
                    ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "it": it,
                          "args": vars(args), "val": val}
                    torch.save(ck, os.path.join(args.out, "last.pt"))
                    if val < best:
                        best = val
                        torch.save(ck, os.path.join(args.out, "best.pt"))
                dist.barrier()
            if it >= args.max_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
