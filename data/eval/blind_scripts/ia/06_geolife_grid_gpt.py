"""Autoregressive grid-cell model on GeoLife (Beijing), evaluated on held-out users.

PLT files are read directly, clipped to the 5th ring bounding box, discretised
into a 250 m grid and de-duplicated. Users are split into train / val so the
reported perplexity is on people the model has never seen.

    torchrun --nproc_per_node=4 06_geolife_grid_gpt.py --geolife_dir /data/Geolife/Data
"""
import argparse
import glob
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BBOX = (116.20, 39.75, 116.55, 40.03)  # lon_min, lat_min, lon_max, lat_max
BOS, PAD = 0, 1


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geolife_dir", default="/data/Geolife/Data")
    ap.add_argument("--cell_m", type=float, default=250.0)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--n_layer", type=int, default=6)
    ap.add_argument("--n_head", type=int, default=8)
    ap.add_argument("--n_embd", type=int, default=384)
    ap.add_argument("--val_users", type=int, default=18)
    ap.add_argument("--jitter_m", type=float, default=15.0, help="GPS noise augmentation")
    ap.add_argument("--batch_size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--ckpt", default="ckpt/geolife_gpt.pt")
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def read_user(user_dir):
    trajs = []
    for f in sorted(glob.glob(os.path.join(user_dir, "Trajectory", "*.plt"))):
        df = pd.read_csv(f, skiprows=6, header=None, usecols=[0, 1], names=["lat", "lon"])
        m = (df.lon.between(BBOX[0], BBOX[2])) & (df.lat.between(BBOX[1], BBOX[3]))
        if m.sum() >= 20:
            trajs.append(df[m].to_numpy(dtype=np.float64))
    return trajs


class GridTokenizer:
    def __init__(self, cell_m):
        lat0 = (BBOX[1] + BBOX[3]) / 2
        self.dlat = cell_m / 111_320.0
        self.dlon = cell_m / (111_320.0 * math.cos(math.radians(lat0)))
        self.nx = int(math.ceil((BBOX[2] - BBOX[0]) / self.dlon))
        self.ny = int(math.ceil((BBOX[3] - BBOX[1]) / self.dlat))
        self.vocab = self.nx * self.ny + 2

    def __call__(self, latlon):
        ix = np.clip(((latlon[:, 1] - BBOX[0]) / self.dlon).astype(np.int64), 0, self.nx - 1)
        iy = np.clip(((latlon[:, 0] - BBOX[1]) / self.dlat).astype(np.int64), 0, self.ny - 1)
        tok = iy * self.nx + ix + 2
        keep = np.concatenate([[True], tok[1:] != tok[:-1]])
        return tok[keep]


class TrajTokens(Dataset):
    def __init__(self, trajs, tok, ctx, jitter_m=0.0):
        self.trajs, self.tok, self.ctx, self.jitter = trajs, tok, ctx, jitter_m

    def __len__(self):
        return len(self.trajs)

    def __getitem__(self, i):
        pts = self.trajs[i]
        if self.jitter > 0:
            pts = pts + np.random.normal(0.0, self.jitter / 111_320.0, size=pts.shape)
        t = self.tok(pts)[: self.ctx]
        seq = np.full(self.ctx + 1, PAD, dtype=np.int64)
        seq[0] = BOS
        seq[1: len(t) + 1] = t
        seq = torch.from_numpy(seq)
        return seq[:-1], seq[1:]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x, causal):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GridGPT(nn.Module):
    def __init__(self, vocab, ctx, n_layer, n_head, d):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        T = idx.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).triu(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x, causal)
        return self.head(self.ln_f(x))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)  # different dropout masks and GPS jitter on every rank

    users = sorted(d for d in os.listdir(args.geolife_dir) if d.isdigit())
    random.shuffle(users)
    val_users, train_users = users[: args.val_users], users[args.val_users:]
    train_trajs = [t for u in train_users for t in read_user(os.path.join(args.geolife_dir, u))]
    val_trajs = [t for u in val_users for t in read_user(os.path.join(args.geolife_dir, u))]

    tok = GridTokenizer(args.cell_m)
    train_ds = TrajTokens(train_trajs, tok, args.ctx, jitter_m=args.jitter_m)
    val_ds = TrajTokens(val_trajs, tok, args.ctx)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64, num_workers=2)

    model = GridGPT(tok.vocab, args.ctx, args.n_layer, args.n_head, args.n_embd).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    total = args.epochs * len(train_dl)
    warm = min(500, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
        print(f"grid {tok.nx}x{tok.ny} vocab={tok.vocab} train_traj={len(train_ds)} val_traj={len(val_ds)}")

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f}", flush=True)

        model.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model.module(x)
                tot[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                          ignore_index=PAD, reduction="sum").double()
                tot[1] += (y != PAD).sum()
        dist.all_reduce(tot)
        val_nll = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val_nll {val_nll:.4f} ppl {math.exp(val_nll):.1f}", flush=True)
            if val_nll < best:
                best = val_nll
                torch.save({"model": model.module.state_dict(), "grid": (tok.nx, tok.ny),
                            "cell_m": args.cell_m, "epoch": epoch}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
