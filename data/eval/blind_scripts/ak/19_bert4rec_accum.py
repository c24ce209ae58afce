#!/usr/bin/env python
"""BERT4Rec on Steam with gradient accumulation, fp16 autocast and early stopping.

Masks are re-drawn every epoch from a generator seeded by (seed, epoch, rank), so
runs are reproducible for a fixed world size. The effective batch is
batch_size * accum * world_size and the learning rate is scaled from the
reference batch of 256 sequences with the square-root rule.

    torchrun --nproc_per_node=4 19_bert4rec_accum.py --data data/steam_seq.pt \
        --batch-size 64 --accum 2 --epochs 200
"""
import argparse
import contextlib
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

REF_BATCH = 256


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--max-len", type=int, default=100)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--base-lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="out/bert4rec_steam")
    return p.parse_args()


class MaskedSeqs(Dataset):
    def __init__(self, seqs, num_items, max_len, mask_prob):
        self.seqs = [s[:-2] for s in seqs if len(s) >= 3]
        self.mask_id = num_items + 1
        self.max_len, self.mask_prob = max_len, mask_prob
        self.masks = None

    def redraw(self, gen):
        # one boolean mask per sequence, drawn in the main process
        self.masks = [torch.rand(min(len(s), self.max_len), generator=gen) < self.mask_prob
                      for s in self.seqs]
        for m in self.masks:
            if not m.any():
                m[-1] = True

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = torch.tensor(self.seqs[i][-self.max_len:])
        m = self.masks[i]
        x = s.masked_fill(m, self.mask_id)
        y = s.masked_fill(~m, 0)
        pad = self.max_len - s.numel()
        return F.pad(x, (pad, 0)), F.pad(y, (pad, 0))


class HoldOut(Dataset):
    def __init__(self, seqs, num_items, max_len, which):
        self.rows = []
        for s in seqs:
            hist, tgt = (s[:-2], s[-2]) if which == "val" else (s[:-1], s[-1])
            h = (hist + [num_items + 1])[-max_len:]
            self.rows.append(([0] * (max_len - len(h)) + h, tgt))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        h, t = self.rows[i]
        return torch.tensor(h), torch.tensor(t)


class BERT4Rec(nn.Module):
    def __init__(self, num_items, max_len, d, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(num_items + 2, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.norm = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, activation="gelu",
                                           batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.out_bias = nn.Parameter(torch.zeros(num_items + 2))

    def forward(self, x):
        h = self.norm(self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device)))
        h = self.enc(h, src_key_padding_mask=(x == 0))
        return h @ self.tok.weight.t() + self.out_bias


@torch.no_grad()
def full_rank_metrics(model, loader, num_items, device, k=10):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, t in loader:
        x, t = x.to(device), t.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            scores = model(x)[:, -1].float()
        scores[:, 0] = -1e9
        scores[:, num_items + 1:] = -1e9  # mask token
        r = (scores > scores.gather(1, t[:, None])).sum(1)
        acc[0] += (r < k).sum()
        acc[1] += ((r < k).double() / torch.log2(r.double() + 2)).sum()
        acc[2] += x.size(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    blob = torch.load(args.data)
    seqs, num_items = blob["seqs"], blob["num_items"]
    train_ds = MaskedSeqs(seqs, num_items, args.max_len, args.mask_prob)
    val_ds = HoldOut(seqs, num_items, args.max_len, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=256, num_workers=2)

    global_batch = args.batch_size * args.accum * world
    lr = args.base_lr * math.sqrt(global_batch / REF_BATCH)
    torch.manual_seed(args.seed)
    model = DDP(BERT4Rec(num_items, args.max_len, args.hidden, args.layers, args.heads).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best, bad = 0, -1.0, 0
    last_path = os.path.join(args.out, "last.pt")
    if os.path.exists(last_path):
        ck = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best, bad = ck["epoch"] + 1, ck["best"], ck["bad"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_batch}, lr {lr:.2e}, start epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        gen = torch.Generator().manual_seed(args.seed * 100003 + epoch * 97 + rank)
        train_ds.redraw(gen)
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                       ignore_index=0) / args.accum
                scaler.scale(loss).backward()
            if last_micro:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)

        hr, ndcg = full_rank_metrics(model, val_loader, num_items, device)
        improved = ndcg > best
        best, bad = (ndcg, 0) if improved else (best, bad + 1)
        if rank == 0:
            print(f"epoch {epoch} HR@10 {hr:.4f} NDCG@10 {ndcg:.4f} best {best:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best": best, "bad": bad}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if improved:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()
        # ndcg comes out of an all-reduce, so every rank takes the same decision
        if bad >= args.patience:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
