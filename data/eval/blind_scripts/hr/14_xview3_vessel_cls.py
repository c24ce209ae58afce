"""Vessel / no-vessel chip classification on Sentinel-1 VV+VH (xView3-derived 128x128 chips).

Chips were cut around xView3 detections (positives) and at random sea locations
(negatives, ~4:1). Stored as per-scene .npz shards; the manifest lists every chip.
This classifier is the second stage of the detector (filters false alarms of the
CFAR stage).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        14_xview3_vessel_cls.py --manifest /shared/xview3_chips/manifest.parquet
"""
import argparse
import os
import time
from functools import lru_cache

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--out-dir", default="/shared/experiments/vessel_cls")
    ap.add_argument("--arch", default="resnet34")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--pos-weight", type=float, default=2.0)
    return ap.parse_args()


@lru_cache(maxsize=16)
def load_shard(path):
    with np.load(path) as z:
        return z["chips"]  # (N, 2, 128, 128) float16, dB


class ChipDataset(Dataset):
    def __init__(self, df, train):
        self.shard = df["shard"].tolist()
        self.idx = df["index"].astype(int).tolist()
        self.label = df["is_vessel"].astype(np.float32).tolist()
        self.train = train

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        x = load_shard(self.shard[i])[self.idx[i]].astype(np.float32)
        x = np.clip((x + 20.0) / 10.0, -3, 5)
        if self.train:
            if np.random.rand() < 0.5:
                x = x[:, :, ::-1]
            if np.random.rand() < 0.5:
                x = x[:, ::-1]
            x = np.rot90(x, np.random.randint(4), (1, 2))
            x = x + np.random.normal(0, 0.05, x.shape).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.tensor(self.label[i])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_parquet(args.manifest)
    train_df = df[df.split == "train"].reset_index(drop=True)
    val_df = df[df.split == "validation"].reset_index(drop=True)
    train_ds = ChipDataset(train_df, train=True)
    val_ds = ChipDataset(val_df.iloc[rank::world], train=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, batch_size=512, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.arch, pretrained=False, in_chans=2, num_classes=1).to(device)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.batch_size * world
    lr = args.lr * global_bs / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = args.epochs * len(train_dl)
    warm = len(train_dl)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm),
         torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - warm)],
        milestones=[warm])
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(args.pos_weight, device=device))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"{len(train_ds)} train chips, {len(val_df)} val chips, global batch {global_bs}, lr {lr:.2e}")
    best_ap = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = model(x).squeeze(1)
            loss = crit(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(stats)

        model.eval()
        scores, labels = [], []
        with torch.no_grad():
            for x, y in val_dl:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    s = model.module(x.to(device, non_blocking=True)).squeeze(1).float().sigmoid()
                scores.append(s.cpu())
                labels.append(y)
        local = torch.stack([torch.cat(scores), torch.cat(labels)], 1).numpy()
        parts = [None] * world
        dist.all_gather_object(parts, local)

        if rank == 0:
            allv = np.concatenate(parts)
            ap = average_precision_score(allv[:, 1], allv[:, 0])
            acc = ((allv[:, 0] > 0.5) == (allv[:, 1] > 0.5)).mean()
            print(f"epoch {epoch:2d} loss {(stats[0] / stats[1]).item():.4f} val AP {ap:.4f} acc {acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "arch": args.arch, "epoch": epoch, "ap": ap}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if ap > best_ap:
                best_ap = ap
                torch.save(state, os.path.join(args.out_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
