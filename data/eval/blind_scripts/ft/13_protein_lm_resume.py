#!/usr/bin/env python
"""ESM-style protein masked LM, long-running job that is restarted from its last checkpoint.

Sequences go into fixed length buckets (<=128, <=256, <=512, <=1024); every batch comes from
one bucket and holds at most --max-tokens padded tokens.

    torchrun --nproc_per_node=8 13_protein_lm_resume.py --train data/ur50_train.txt \
        --valid data/ur50_valid.txt --ckpt-dir /checkpoints/esm_150m --resume auto
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

TOKS = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + ["<mask>"]
IDX = {t: i for i, t in enumerate(TOKS)}
BUCKETS = (128, 256, 512, 1024)


class SeqFile(Dataset):
    """One protein sequence per line."""

    def __init__(self, path, max_len=1022):
        with open(path) as f:
            self.seqs = [l.strip()[:max_len] for l in f if l.strip()]
        self.lens = np.array([len(s) + 2 for s in self.seqs])

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return torch.tensor([IDX["<cls>"]] + [IDX.get(a, IDX["<unk>"]) for a in self.seqs[i]] + [IDX["<eos>"]])


def collate_mlm(seqs, p=0.15):
    x = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=IDX["<pad>"])
    maskable = x > IDX["<unk>"]
    sel = (torch.rand(x.shape) < p) & maskable & (x != IDX["<mask>"])
    y = x.masked_fill(~sel, -100)
    r = torch.rand(x.shape)
    x = x.masked_fill(sel & (r < 0.8), IDX["<mask>"])
    rnd = sel & (r >= 0.8) & (r < 0.9)
    x[rnd] = torch.randint(4, 4 + 25, (int(rnd.sum()),))
    return x, y


class BucketedDistributedSampler(Sampler):
    def __init__(self, lens, max_tokens, num_replicas, rank, seed=0, shuffle=True, pad=True):
        self.lens, self.max_tokens = lens, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.shuffle, self.pad = seed, shuffle, pad
        self.epoch = 0
        self.bucket_of = np.searchsorted(BUCKETS, lens)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        batches = []
        for b, width in enumerate(BUCKETS):
            members = np.flatnonzero(self.bucket_of == b)
            if self.shuffle:
                members = rng.permutation(members)
            bs = max(1, self.max_tokens // width)
            batches += [members[i:i + bs].tolist() for i in range(0, len(members), bs)]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.pad and len(batches) % self.num_replicas:
            batches += batches[: self.num_replicas - len(batches) % self.num_replicas]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class RotaryAttentionBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        inv = 1.0 / (10000 ** (torch.arange(0, d // h, 2).float() / (d // h)))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotate(self, t):
        T = t.size(-2)
        f = torch.outer(torch.arange(T, device=t.device, dtype=self.inv_freq.dtype), self.inv_freq)
        cos, sin = f.cos().repeat(1, 2).to(t.dtype), f.sin().repeat(1, 2).to(t.dtype)
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat([-t2, t1], -1) * sin

    def forward(self, x, key_mask):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, attn_mask=key_mask[:, None, None, :])
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.ln2(x))


class ESMLike(nn.Module):
    def __init__(self, d=640, layers=30, heads=20):
        super().__init__()
        self.emb = nn.Embedding(len(TOKS), d, padding_idx=IDX["<pad>"])
        self.blocks = nn.ModuleList(RotaryAttentionBlock(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm = nn.Linear(d, len(TOKS))

    def forward(self, x):
        key_mask = x != IDX["<pad>"]
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h, key_mask)
        return self.lm(self.ln(h))


def latest_checkpoint(ckpt_dir):
    paths = sorted(glob.glob(os.path.join(ckpt_dir, "ckpt_*.pt")))
    return paths[-1] if paths else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--resume", default=None, help="path, or 'auto' for the newest in --ckpt-dir")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--update-freq", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--total-updates", type=int, default=250000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, valid_ds = SeqFile(args.train), SeqFile(args.valid)
    train_sampler = BucketedDistributedSampler(train_ds.lens, args.max_tokens, world, rank, seed=args.seed)
    valid_sampler = BucketedDistributedSampler(valid_ds.lens, args.max_tokens, world, rank, shuffle=False, pad=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate_mlm, num_workers=6,
                              pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_sampler=valid_sampler, collate_fn=collate_mlm, num_workers=2)

    model = ESMLike().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    schedule = lambda u: min((u + 1) / args.warmup, max(0.1, 1 - u / args.total_updates))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    start_epoch, updates = 0, 0
    resume = latest_checkpoint(args.ckpt_dir) if args.resume == "auto" else args.resume
    if resume:
        ckpt = torch.load(resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, updates = ckpt["epoch"] + 1, ckpt["updates"]
        if rank == 0:
            print(f"resumed from {resume} at epoch {start_epoch}, {updates} updates", flush=True)
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        n = len(train_sampler)
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = (i + 1) % args.update_freq == 0 or i + 1 == n
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().transpose(1, 2), y) / args.update_freq
                loss.backward()
            if sync:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                updates += 1
                if rank == 0 and updates % 100 == 0:
                    print(f"epoch {epoch} upd {updates} loss {loss.item() * args.update_freq:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.3f}s/batch", flush=True)
            if updates >= args.total_updates:
                break

        model.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in valid_loader:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model.module(x)
                tot[0] += F.cross_entropy(logits.float().transpose(1, 2), y, reduction="sum")
                tot[1] += (y != -100).sum()
        dist.all_reduce(tot)
        if rank == 0:
            vl = (tot[0] / tot[1]).item()
            print(f"epoch {epoch}: valid loss {vl:.4f} ppl {math.exp(vl):.3f}", flush=True)
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "updates": updates},
                       os.path.join(args.ckpt_dir, f"ckpt_{epoch:04d}.pt"))
        dist.barrier()
        if updates >= args.total_updates:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
