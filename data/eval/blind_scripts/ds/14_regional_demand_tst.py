"""Channel-independent transformer trained on per-region demand extracts.

The warehouse exports one parquet file per region (region=NE.parquet, ...).
Regions are assigned round-robin to ranks so every process only parses its
own files.

    torchrun --nproc_per_node=8 14_regional_demand_tst.py --data_dir /data/exports/daily_by_region
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/exports/daily_by_region")
    p.add_argument("--out_dir", default="/data/models/regional_tst")
    p.add_argument("--lookback", type=int, default=168)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--patch", type=int, default=7)
    p.add_argument("--d_model", type=int, default=192)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--holdout", type=int, default=56)
    return p.parse_args()


def load_regions(files):
    frames = []
    for f in files:
        d = pd.read_parquet(f, columns=["sku", "store", "date", "units", "on_promo"])
        d["region"] = os.path.basename(f).split("=")[-1].replace(".parquet", "")
        frames.append(d)
    df = pd.concat(frames, ignore_index=True)
    idx = ["region", "store", "sku"]
    units = df.pivot_table(index=idx, columns="date", values="units", aggfunc="sum").fillna(0.0)
    promo = df.pivot_table(index=idx, columns="date", values="on_promo", aggfunc="max")
    promo = promo.reindex(units.index).fillna(0.0)
    return units.to_numpy(np.float32), promo.to_numpy(np.float32)


class RegionWindows(Dataset):
    def __init__(self, units, promo, lookback, horizon, end, stride=3):
        self.units, self.promo = units, promo
        self.L, self.H = lookback, horizon
        self.rows = [(s, t) for s in range(len(units)) for t in range(lookback, end - horizon + 1, stride)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        s, t = self.rows[i]
        hist = self.units[s, t - self.L:t]
        mu, sd = hist.mean(), hist.std() + 1.0
        x = np.stack([(hist - mu) / sd, self.promo[s, t - self.L:t]], 0)
        fut_promo = self.promo[s, t:t + self.H]
        y = (self.units[s, t:t + self.H] - mu) / sd
        return torch.from_numpy(x), torch.from_numpy(fut_promo), torch.from_numpy(y)


class PatchTransformer(nn.Module):
    def __init__(self, lookback, horizon, patch, d_model, depth, heads):
        super().__init__()
        self.patch = patch
        n = lookback // patch
        self.embed = nn.Linear(2 * patch, d_model)
        self.pos = nn.Parameter(torch.zeros(1, n, d_model))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, 0.1,
                                                                    batch_first=True, norm_first=True), depth)
        self.promo_proj = nn.Linear(horizon, d_model)
        self.head = nn.Linear(n * d_model + d_model, horizon)

    def forward(self, x, fut_promo):
        B = x.size(0)
        p = x.unfold(-1, self.patch, self.patch)             # B, 2, n, patch
        p = p.permute(0, 2, 1, 3).reshape(B, p.size(2), -1)  # B, n, 2*patch
        h = self.enc(self.embed(p) + self.pos)
        return self.head(torch.cat([h.flatten(1), self.promo_proj(fut_promo)], 1))


@torch.no_grad()
def holdout_metrics(net, units, promo, args, device):
    net.eval()
    T = units.shape[1]
    origins = range(T - args.holdout, T - args.horizon + 1, 7)
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for o in origins:
        for b in range(0, len(units), 4096):
            u = units[b:b + 4096]
            hist = u[:, o - args.lookback:o]
            mu, sd = hist.mean(1, keepdims=True), hist.std(1, keepdims=True) + 1.0
            x = np.stack([(hist - mu) / sd, promo[b:b + 4096, o - args.lookback:o]], 1)
            fp = promo[b:b + 4096, o:o + args.horizon]
            pred = net(torch.from_numpy(x).to(device), torch.from_numpy(fp).to(device)).cpu().numpy()
            pred = np.clip(pred * sd + mu, 0, None)
            true = u[:, o:o + args.horizon]
            acc[0] += float(np.abs(pred - true).sum())
            acc[1] += float(true.sum())
    net.train()
    return acc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    files = sorted(glob.glob(os.path.join(args.data_dir, "region=*.parquet")))
    my_files = files[rank::world]
    units, promo = load_regions(my_files)
    T = units.shape[1]
    train_end = T - args.holdout
    ds = RegionWindows(units, promo, args.lookback, args.horizon, train_end)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True, num_workers=4,
                        pin_memory=True, persistent_workers=True)
    print(f"[rank {rank}] regions {[os.path.basename(f) for f in my_files]} "
          f"series {len(units)} windows {len(ds)}", flush=True)

    model = PatchTransformer(args.lookback, args.horizon, args.patch, args.d_model, args.depth, args.heads)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, fp, y in loader:
            x, fp, y = x.to(device, non_blocking=True), fp.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.huber_loss(model(x, fp), y, delta=2.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        acc = holdout_metrics(model.module, units, promo, args, device)
        dist.all_reduce(acc)
        dist.all_reduce(loss_acc)
        wape = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch} train_huber {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"holdout_wape {wape:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if wape < best:
                best = wape
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "wape": wape,
                            "args": vars(args)}, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
