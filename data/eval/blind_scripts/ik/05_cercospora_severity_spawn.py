"""Cercospora leaf spot severity (CLS score 1-9) in sugar beet from multispectral plot tiles.

Tiles are 10-band GeoTIFFs (RedEdge-MX dual camera) already clipped per plot.
Single node, started with mp.spawn so it can run on the lab workstation
without torchrun:

    python 05_cercospora_severity_spawn.py --tiles /data/cls/tiles --meta /data/cls/meta.csv --gpus 4
"""
import argparse
import os
import socket
from contextlib import closing, nullcontext

import numpy as np
import pandas as pd
import tifffile
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BANDS = 10
# reflectance scale of the calibrated tiles
SCALE = 1.0 / 32768.0


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", required=True)
    p.add_argument("--meta", required=True, help="plot_id,tile,score,season,split")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU, per micro-step")
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="out/cls_severity")
    return p.parse_args()


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SeverityTiles(Dataset):
    def __init__(self, tiles_dir, df, size, train):
        self.paths = [os.path.join(tiles_dir, t) for t in df["tile"]]
        self.scores = df["score"].astype(np.float32).values
        self.size = size
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        arr = tifffile.imread(self.paths[i]).astype(np.float32) * SCALE  # H, W, 10
        x = torch.from_numpy(arr).permute(2, 0, 1)[None]
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
        if self.train:
            k = int(np.random.randint(4))
            x = torch.rot90(x, k, dims=(1, 2))
            if np.random.rand() < 0.5:
                x = x.flip(2)
            x = x * (1.0 + 0.08 * (torch.rand(BANDS, 1, 1) - 0.5))  # illumination jitter per band
            x = x + 0.005 * torch.randn_like(x)
        ndvi = (x[9] - x[5]) / (x[9] + x[5] + 1e-6)  # NIR 842, red 668
        x = torch.cat([x, ndvi[None]], 0)
        return x, torch.tensor(self.scores[i])


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SeverityNet(nn.Module):
    def __init__(self, cin=BANDS + 1):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(cin, 64), conv_bn(64, 64),
            conv_bn(64, 128, 2), conv_bn(128, 128),
            conv_bn(128, 256, 2), conv_bn(256, 256),
            conv_bn(256, 512, 2), conv_bn(512, 512),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(512, 1))

    def forward(self, x):
        return self.head(self.features(x)).squeeze(1)


@torch.no_grad()
def score(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        p = net(x).clamp(1, 9)
        s[0] += (p - y).abs().sum()
        s[1] += ((p - y) ** 2).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).sqrt().item()


def worker(rank, world_size, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.backends.cudnn.benchmark = True
    np.random.seed(1234 + rank)
    torch.manual_seed(1234)  # same init everywhere; DDP broadcasts anyway

    meta = pd.read_csv(args.meta)
    train_ds = SeverityTiles(args.tiles, meta[meta.split == "train"], args.size, True)
    val_ds = SeverityTiles(args.tiles, meta[meta.split == "val"], args.size, False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=args.workers > 0)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=64,
                            num_workers=args.workers)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(SeverityNet()).to(device)
    ddp = DDP(net, device_ids=[rank])
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-2)
    updates_per_epoch = len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * updates_per_epoch)

    best = float("inf")
    for epoch in range(args.epochs):
        ddp.train()
        sampler.set_epoch(epoch)
        opt.zero_grad(set_to_none=True)
        for it, (x, y) in enumerate(train_loader):
            if it >= updates_per_epoch * args.accum:
                break  # same count on every rank: drop_last + identical len(train_loader)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (it + 1) % args.accum == 0
            with (nullcontext() if last_micro else ddp.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = ddp(x)
                loss = F.smooth_l1_loss(pred.float(), y) / args.accum
                loss.backward()
            if last_micro:
                nn.utils.clip_grad_norm_(net.parameters(), 2.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)

        mae, rmse = score(net, val_loader, device)
        if rank == 0:
            print(f"[{epoch:03d}] val MAE {mae:.3f}  RMSE {rmse:.3f}  lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if mae < best:
                best = mae
                torch.save({"model": net.state_dict(), "epoch": epoch, "mae": mae}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    port = free_port()
    mp.spawn(worker, args=(args.gpus, args, port), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
