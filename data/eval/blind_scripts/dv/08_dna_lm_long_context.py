#!/usr/bin/env python
"""Causal nucleotide LM on full-length human transcripts (GENCODE, up to 16 kb).

Single-nucleotide tokens, rotary attention (SDPA / flash), activation checkpointing
per block, variable-length batches packed to a token budget.

    torchrun --nproc_per_node=8 08_dna_lm_long_context.py \
        --fasta data/gencode.v44.transcripts.fa --out runs/txlm_16k
"""
import argparse
import contextlib
import math
import os
import random
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter

NUC = {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}
PAD, BOS, EOS = 0, 6, 7
VOCAB = 8


def load_fasta(path):
    names, seqs, cur = [], [], []
    with open(path) as fh:
        for line in fh:
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                cur = []
                names.append(line[1:].split("|")[0].strip())
            else:
                cur.append(line.strip().upper())
    if cur:
        seqs.append("".join(cur))
    return names, seqs


class Transcripts(Dataset):
    def __init__(self, seqs, max_len):
        self.seqs = seqs
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len - 2:
            start = random.randint(0, len(s) - (self.max_len - 2))
            s = s[start:start + self.max_len - 2]
        ids = [BOS] + [NUC.get(c, 5) for c in s] + [EOS]
        return torch.tensor(ids, dtype=torch.long)


class DistributedTokenBudgetSampler(Sampler):
    """Packs the whole dataset into token-budget batches (identically on every rank),
    then deals the batches out so each rank gets the same number of batches."""

    def __init__(self, lengths, max_tokens, rank, world_size, seed=0):
        self.lengths = np.asarray(lengths)
        self.max_tokens, self.rank, self.world = max_tokens, rank, world_size
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _all_batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        batches = []
        for s in range(0, len(order), 4096):                  # sort within pools of 4096
            pool = sorted(order[s:s + 4096], key=lambda i: self.lengths[i])
            cur, longest = [], 0
            for i in pool:
                L = int(self.lengths[i])
                if cur and max(longest, L) * (len(cur) + 1) > self.max_tokens:
                    batches.append(cur)
                    cur, longest = [], 0
                cur.append(i)
                longest = max(longest, L)
            if cur:
                batches.append(cur)
        rng.shuffle(batches)
        usable = len(batches) // self.world * self.world
        return batches[:usable]

    def __iter__(self):
        return iter(self._all_batches()[self.rank::self.world])

    def __len__(self):
        return len(self._all_batches()) // self.world


def pad_batch(items):
    L = max(len(x) for x in items)
    out = torch.full((len(items), L), PAD, dtype=torch.long)
    for i, x in enumerate(items):
        out[i, : len(x)] = x
    return out


def rotary(x, base=500000.0):
    # x: (B, H, T, D)
    T, D = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.ln2(x))


class TxLM(nn.Module):
    def __init__(self, d=512, layers=12, heads=8, grad_ckpt=True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.grad_ckpt = grad_ckpt

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, ids, reduction="mean"):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1),
                           ignore_index=PAD, reduction=reduction)


@torch.no_grad()
def evaluate(model, seqs, device, rank, world, max_len):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(rank, len(seqs), world):          # unwrapped model: no collectives inside
        ids = torch.tensor([[BOS] + [NUC.get(c, 5) for c in seqs[i][: max_len - 2]] + [EOS]], device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        acc[0] += lm_loss(logits, ids, reduction="sum").double()
        acc[1] += ids.size(1) - 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item() / math.log(2)       # bits per nucleotide


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--valid-frac", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)            # only used for crop offsets in the workers
    torch.manual_seed(args.seed)

    names, seqs = load_fasta(args.fasta)
    # split by gene so isoforms of one gene never straddle train/valid; hash-based, same on every rank
    genes = sorted({n.split(".")[0] for n in names})
    valid_genes = {g for g in genes if (hash_gene(g) % 1000) < args.valid_frac * 1000}
    train_seqs = [s for n, s in zip(names, seqs) if n.split(".")[0] not in valid_genes]
    valid_seqs = [s for n, s in zip(names, seqs) if n.split(".")[0] in valid_genes]
    lengths = [min(len(s) + 2, args.max_len) for s in train_seqs]

    sampler = DistributedTokenBudgetSampler(lengths, args.max_tokens, rank, world, seed=args.seed)
    loader = DataLoader(Transcripts(train_seqs, args.max_len), batch_sampler=sampler,
                        collate_fn=pad_batch, num_workers=4, pin_memory=True)

    model = TxLM().to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * math.ceil(len(sampler) / args.accum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch, step = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, step = ck["epoch"] + 1, ck["step"]
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        n_batches = len(sampler)
        t0, ntok = time.time(), 0
        for i, ids in enumerate(loader):
            ids = ids.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0 or (i + 1) == n_batches
            with contextlib.nullcontext() if boundary else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = lm_loss(model(ids), ids)
                (loss / args.accum).backward()
            ntok += int(ids.ne(PAD).sum())
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if writer is not None and step % 25 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/tok_per_s_gpu", ntok / (time.time() - t0), step)
                t0, ntok = time.time(), 0

        bpn = evaluate(model.module, valid_seqs, device, rank, world, args.max_len)
        if rank == 0:
            print(f"epoch {epoch} step {step} valid bits/nt {bpn:.4f}", flush=True)
            writer.add_scalar("valid/bits_per_nt", bpn, step)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def hash_gene(g):
    # stable across processes (python's hash() is salted per process)
    return zlib.crc32(g.encode())


if __name__ == "__main__":
    main()
