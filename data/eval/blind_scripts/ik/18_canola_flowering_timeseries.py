"""Canola flowering-stage classification from multi-date UAV plot sequences.

Each sample is a plot seen on T consecutive flights (RGB crops, 2-4 days
apart). A shared 2D CNN encodes every date, a GRU runs over the dates and the
last hidden state predicts the BBCH flowering class at the last flight.

    torchrun --nproc_per_node=4 18_canola_flowering_timeseries.py --index /data/canola/sequences.parquet
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms.functional as TF

BBCH = ["<60", "61-63", "64-65", "66-67", ">=69"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True, help="parquet: seq_id, plot_id, season, split, files (list), bbch")
    p.add_argument("--img-root", default="/data/canola/crops")
    p.add_argument("--t", type=int, default=5)
    p.add_argument("--size", type=int, default=192)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/canola_seq")
    return p.parse_args()


class PlotSequences(Dataset):
    MEAN = torch.tensor([0.50, 0.50, 0.36]).view(1, 3, 1, 1)
    STD = torch.tensor([0.21, 0.19, 0.20]).view(1, 3, 1, 1)

    def __init__(self, df, img_root, t, size, train):
        self.df = df.reset_index(drop=True)
        self.root = img_root
        self.t = t
        self.size = size
        self.train = train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        files = list(r.files)[-self.t:]
        imgs = [TF.to_tensor(Image.open(os.path.join(self.root, f)).convert("RGB").resize((self.size, self.size)))
                for f in files]
        x = torch.stack(imgs)  # T,3,H,W
        if self.train:
            # same geometric transform for all dates of a plot, photometric jitter per date
            if torch.rand(1) < 0.5:
                x = x.flip(-1)
            if torch.rand(1) < 0.5:
                x = x.flip(-2)
            x = torch.rot90(x, int(torch.randint(0, 4, (1,))), dims=(-2, -1))
            x = x * (0.85 + 0.3 * torch.rand(x.size(0), 1, 1, 1))
            # randomly drop one date (cloud / missed flight)
            if torch.rand(1) < 0.2:
                x[int(torch.randint(0, x.size(0) - 1, (1,)))] = 0
        x = (x.clamp(0, 1) - self.MEAN) / self.STD
        return x, int(r.bbch)


class SeqClassifier(nn.Module):
    def __init__(self, num_classes, hidden=256):
        super().__init__()
        enc = torchvision.models.efficientnet_b0(weights="IMAGENET1K_V1")
        enc.classifier = nn.Identity()
        self.encoder = enc
        self.gru = nn.GRU(1280, hidden, num_layers=1, batch_first=True)
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Dropout(0.3), nn.Linear(hidden, num_classes))

    def forward(self, x):
        b, t = x.shape[:2]
        f = self.encoder(x.flatten(0, 1)).view(b, t, -1)
        _, h = self.gru(f)
        return self.head(h[-1])


@torch.no_grad()
def evaluate(net, loader, device, k):
    net.eval()
    cm = torch.zeros(k * k, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        cm += torch.bincount(y * k + pred, minlength=k * k).float()
    dist.all_reduce(cm)
    cm = cm.view(k, k)
    acc = (cm.diag().sum() / cm.sum()).item()
    within_one = sum(cm[i, j] for i in range(k) for j in range(k) if abs(i - j) <= 1).item() / cm.sum().item()
    return acc, within_one


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3 + rank)

    df = pd.read_parquet(args.index)
    df = df[df.files.apply(len) >= args.t]
    train_ds = PlotSequences(df[df.split == "train"], args.img_root, args.t, args.size, train=True)
    val_df = df[df.split == "val"].reset_index(drop=True)
    val_ds = PlotSequences(val_df.iloc[rank::world], args.img_root, args.t, args.size, train=False)

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, prefetch_factor=4)
    val_loader = DataLoader(val_ds, batch_size=32, shuffle=False, num_workers=args.workers)

    # 16 sequences x 5 dates = 80 images per GPU through the BN encoder, SyncBN anyway for stable stats
    net = nn.SyncBatchNorm.convert_sync_batchnorm(SeqClassifier(len(BBCH))).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW([
        {"params": net.encoder.parameters(), "lr": args.lr * 0.3},
        {"params": list(net.gru.parameters()) + list(net.head.parameters()), "lr": args.lr},
    ], weight_decay=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr * 0.3, args.lr], epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)
    counts = np.bincount(train_ds.df.bbch.values, minlength=len(BBCH))
    cls_w = torch.tensor((counts.sum() / (len(BBCH) * np.maximum(counts, 1))) ** 0.5, dtype=torch.float32,
                         device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train seqs {len(train_ds)} val seqs {len(val_df)} class counts {counts.tolist()}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, weight=cls_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        acc, w1 = evaluate(net, val_loader, device, len(BBCH))
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} val acc {acc:.4f} "
                  f"within-one {w1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": net.state_dict(), "epoch": epoch, "acc": acc, "t": args.t},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
