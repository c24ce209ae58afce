#!/usr/bin/env python
"""trRosetta-style 2D ResNet predicting inter-residue distance distributions from MSA features.

Input features are precomputed from the a3m by make_features.py: query one-hot,
sequence-weighted profile and positional entropy (1D, tiled to 2D), plus the
APC-corrected coupling strength from a shrunk covariance (2D). Targets come from
the PDB chain's C-beta distances. Training uses random 128x128 crops of the pair map.

    torchrun --nproc_per_node=8 08_resnet_distogram.py --data data/trrosetta --batch_size 2
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_BINS = 37


class TrRosettaSet(Dataset):
    def __init__(self, root, ids, crop):
        self.root, self.ids, self.crop = root, ids, crop

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        pid = self.ids[i]
        feats = np.load(os.path.join(self.root, "features", pid + ".npz"))
        f1d = feats["f1d"].astype(np.float32)          # L x 43: query one-hot, profile, entropy
        f2d = feats["f2d"].astype(np.float32)          # L x L x 1: APC-corrected coupling strength
        d = np.load(os.path.join(self.root, "npz", pid + ".npz"))["dist6d"].astype(np.float32)
        L = f1d.shape[0]
        if self.crop and L > self.crop:
            a, b = random.randint(0, L - self.crop), random.randint(0, L - self.crop)
        else:
            a = b = 0
        c = self.crop if self.crop else L
        left, right = f1d[a:a + c], f1d[b:b + c]
        pair = np.concatenate([
            np.broadcast_to(left[:, None], (left.shape[0], right.shape[0], 43)),
            np.broadcast_to(right[None, :], (left.shape[0], right.shape[0], 43)),
            f2d[a:a + c, b:b + c]], -1)
        dist_ = d[a:a + c, b:b + c]
        target = np.clip(((dist_ - 2.0) / 0.5).astype(np.int64), 0, N_BINS - 1)
        target[(dist_ > 20.0) | (dist_ < 1e-3)] = N_BINS - 1
        sep = np.abs(np.arange(a, a + left.shape[0])[:, None] - np.arange(b, b + right.shape[0])[None])
        if self.crop and L < self.crop:      # short chains are zero-padded to the crop size
            p = self.crop - L
            pair = np.pad(pair, ((0, p), (0, p), (0, 0)))
            target = np.pad(target, ((0, p), (0, p)), constant_values=-100)
            sep = np.pad(sep, ((0, p), (0, p)))
        return torch.from_numpy(pair.transpose(2, 0, 1).copy()), torch.from_numpy(target), torch.from_numpy(sep)


class ResBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)
        self.drop = nn.Dropout2d(0.15)

    def forward(self, x):
        h = F.elu(self.bn1(self.conv1(x)))
        h = self.drop(h)
        h = self.bn2(self.conv2(h))
        return F.elu(x + h)


class DistResNet(nn.Module):
    def __init__(self, in_ch=87, ch=64, n_blocks=36):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_ch, ch, 1, bias=False), nn.BatchNorm2d(ch), nn.ELU())
        self.blocks = nn.Sequential(*[ResBlock(ch, d) for _ in range(n_blocks // 4) for d in (1, 2, 4, 8)])
        self.head = nn.Conv2d(ch, N_BINS, 1)

    def forward(self, x):
        logits = self.head(self.blocks(self.stem(x)))
        return logits


def top_l_precision(logits, target, sep, min_sep=24):
    prob = logits.softmax(1)[:, :12].sum(1)                 # P(d < 8 A)
    hits, total = 0.0, 0.0
    for b in range(prob.shape[0]):
        keep = sep[b] >= min_sep
        p, t = prob[b][keep], target[b][keep] < 12
        k = min(prob.shape[-1], p.numel())
        if k == 0:
            continue
        top = p.topk(k).indices
        hits += t[top].float().sum().item()
        total += k
    return hits, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--crop", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=36)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default="runs/trr_resnet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.data, "split.json")) as f:
        split = json.load(f)
    train_set = TrRosettaSet(args.data, split["train"], args.crop)
    val_set = TrRosettaSet(args.data, split["valid"], crop=None)

    model = DistResNet(ch=args.channels, n_blocks=args.blocks).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=2)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=4)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}:{it}] loss={loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        model.eval()
        stats = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y, sep in val_loader:
                x, y, sep = x.to(device), y.to(device), sep.to(device)
                logits = model(x)
                stats[0] += F.cross_entropy(logits, y, reduction="sum")
                stats[1] += y.numel()
                h, t = top_l_precision(logits, y, sep)
                stats[2] += h
                stats[3] += t
        dist.all_reduce(stats)
        val_loss = (stats[0] / stats[1]).item()
        prec = (stats[2] / stats[3].clamp(min=1)).item()
        scheduler.step(val_loss)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f}  top-L long-range precision {prec:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if prec > best:
                best = prec
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
