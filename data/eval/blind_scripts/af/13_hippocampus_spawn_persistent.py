"""
Hippocampus (MSD Task04, anterior / posterior) segmentation on one node with mp.spawn.

A small residual UNet with BatchNorm (converted to SyncBatchNorm, the per-GPU batch is small)
and an auxiliary boundary head that joins the loss after `--aux_start` epochs.

    python 13_hippocampus_spawn_persistent.py --data /data/Task04_Hippocampus --gpus 4
"""
import argparse
import json
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from monai.data import DataLoader, DistributedSampler, PersistentDataset
from monai.losses import DiceCELoss
from monai.transforms import (Compose, EnsureChannelFirstd, EnsureTyped, LoadImaged, NormalizeIntensityd,
                              RandAffined, RandFlipd, RandGaussianNoised, ResizeWithPadOrCropd)

SHAPE = (48, 64, 48)


def conv_bn(cin, cout, stride=1):
    return nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(inplace=True))


class ResUNetAux(nn.Module):
    def __init__(self, cin=1, ncls=3, f=(24, 48, 96, 192)):
        super().__init__()
        self.enc = nn.ModuleList([conv_bn(cin, f[0])] + [conv_bn(f[i - 1], f[i], 2) for i in range(1, len(f))])
        self.dec = nn.ModuleList([conv_bn(f[i] + f[i - 1], f[i - 1]) for i in range(len(f) - 1, 0, -1)])
        self.seg = nn.Conv3d(f[0], ncls, 1)
        self.boundary = nn.Sequential(conv_bn(f[0], f[0]), nn.Conv3d(f[0], 1, 1))

    def forward(self, x, with_aux=False):
        skips = []
        for e in self.enc:
            x = e(x)
            skips.append(x)
        x = skips.pop()
        for d in self.dec:
            s = skips.pop()
            x = d(torch.cat([F.interpolate(x, size=s.shape[2:], mode="trilinear", align_corners=False), s], 1))
        if with_aux:
            return self.seg(x), self.boundary(x)
        return self.seg(x)


def boundary_target(lbl):
    fg = (lbl > 0).float()
    eroded = -F.max_pool3d(-fg, 3, 1, 1)
    return (fg - eroded).clamp(0, 1)


def get_transforms():
    keys = ["image", "label"]
    det = [LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys),
           NormalizeIntensityd(keys="image", nonzero=True), ResizeWithPadOrCropd(keys=keys, spatial_size=SHAPE),
           EnsureTyped(keys=keys, track_meta=False)]
    train = Compose(det + [
        RandAffined(keys=keys, prob=0.5, rotate_range=(0.3, 0.3, 0.3), scale_range=(0.1, 0.1, 0.1),
                    mode=("bilinear", "nearest")),
        RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
        RandGaussianNoised(keys="image", prob=0.2, std=0.05),
    ])
    return train, Compose(det)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg.seed)

    with open(os.path.join(cfg.data, "dataset.json")) as f:
        items = [{"image": os.path.join(cfg.data, d["image"]), "label": os.path.join(cfg.data, d["label"])}
                 for d in json.load(f)["training"]]
    rs = np.random.RandomState(cfg.seed)  # same permutation on every rank
    perm = rs.permutation(len(items))
    val_items = [items[i] for i in perm[:cfg.n_val]]
    train_items = [items[i] for i in perm[cfg.n_val:]]

    train_tf, val_tf = get_transforms()
    cache_dir = os.path.join(cfg.out, "cache")
    if rank == 0:
        os.makedirs(cache_dir, exist_ok=True)
        warm = PersistentDataset(train_items + val_items, transform=val_tf, cache_dir=cache_dir)
        for i in range(len(warm)):
            warm[i]
    dist.barrier()
    train_ds = PersistentDataset(train_items, transform=train_tf, cache_dir=cache_dir)
    val_ds = PersistentDataset(val_items, transform=val_tf, cache_dir=cache_dir)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False, even_divisible=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.bs, sampler=train_sampler, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=8, sampler=val_sampler, num_workers=2)

    model = ResUNetAux().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    # the boundary head is unused before cfg.aux_start
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    seg_loss = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    start_epoch, best = 0, 0.0
    ckpt_path = os.path.join(cfg.out, "last.pt")
    if cfg.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch >= cfg.aux_start
        t0, run = time.time(), torch.zeros(2, device=device)
        for batch in train_loader:
            x, y = batch["image"].to(device), batch["label"].to(device)
            opt.zero_grad()
            if use_aux:
                logits, edge = model(x, with_aux=True)
                loss = seg_loss(logits, y) + cfg.aux_w * F.binary_cross_entropy_with_logits(edge, boundary_target(y))
            else:
                loss = seg_loss(model(x), y)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.tensor(1.0, device=device)])
        dist.all_reduce(run)

        # per-class dice from summed intersections over the whole validation set
        net = model.module
        net.eval()
        stats = torch.zeros(3, 2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                x, y = batch["image"].to(device), batch["label"].to(device)
                pred = net(x).argmax(1, keepdim=True)
                for c in (1, 2):
                    stats[c, 0] += ((pred == c) & (y == c)).sum()
                    stats[c, 1] += (pred == c).sum() + (y == c).sum()
        dist.all_reduce(stats)
        dice = (2 * stats[1:, 0] / stats[1:, 1].clamp(min=1)).cpu().numpy()
        if rank == 0:
            print(f"ep {epoch:3d} loss {(run[0] / run[1]).item():.4f} dice ant {dice[0]:.4f} post {dice[1]:.4f} "
                  f"aux={use_aux} {time.time() - t0:.1f}s", flush=True)
            if dice.mean() > best:
                best = float(dice.mean())
                torch.save(net.state_dict(), os.path.join(cfg.out, "best.pt"))
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "best": best}, ckpt_path)

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/Task04_Hippocampus")
    ap.add_argument("--out", default="runs/hippocampus")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--aux_start", type=int, default=50)
    ap.add_argument("--aux_w", type=float, default=0.3)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--n_val", type=int, default=52)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    cfg = ap.parse_args()
    os.makedirs(cfg.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)


if __name__ == "__main__":
    main()
