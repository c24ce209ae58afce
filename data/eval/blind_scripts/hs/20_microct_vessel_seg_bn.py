"""Vessel segmentation in synchrotron X-ray micro-CT of cleared mouse brain tissue.

The reconstructed volumes (~4000^3, uint16 zarr) are sampled with a random patch sampler
that draws half of the patches around annotated vessel voxels.  128^3 patches, two per GPU
(the most that fits on a 40 GB A100 with fp16 activations).

    torchrun --nnodes=1 --nproc_per_node=8 20_microct_vessel_seg_bn.py --config vessels.yaml
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("vessels")

DEFAULTS = dict(patch=128, batch_size=2, epochs=150, samples_per_epoch=9600, lr=1e-3,
                weight_decay=1e-4, workers=8, fg_fraction=0.5, val_patches=400, amp=True)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="")
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    with open(a.config) as f:
        cfg.update(yaml.safe_load(f))
    cfg["resume"] = a.resume
    return cfg


class VesselPatchSampler(Dataset):
    def __init__(self, volumes, patch, n, fg_fraction, seed, window=(2000, 24000)):
        self.raw = [zarr.open(v["raw"], mode="r") for v in volumes]
        self.lab = [zarr.open(v["label"], mode="r") for v in volumes]
        # vessel voxel coordinates, precomputed at 4x downsampling by prepare_vessels.py
        self.fg = [np.load(v["fg_coords"]) * 4 for v in volumes]
        self.patch, self.n, self.fg_fraction = patch, n, fg_fraction
        self.lo, self.hi = window
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, idx))
        v = int(rng.integers(len(self.raw)))
        shape = np.array(self.raw[v].shape)
        p = self.patch
        if rng.random() < self.fg_fraction:
            c = self.fg[v][rng.integers(len(self.fg[v]))] + rng.integers(-p // 4, p // 4 + 1, 3)
            o = np.clip(c - p // 2, 0, shape - p)
        else:
            o = np.array([rng.integers(0, s - p + 1) for s in shape])
        sl = tuple(slice(int(a), int(a) + p) for a in o)
        raw = np.asarray(self.raw[v][sl], dtype=np.float32)
        lab = np.asarray(self.lab[v][sl] > 0, dtype=np.float32)
        raw = np.clip((raw - self.lo) / (self.hi - self.lo), 0, 1)
        for ax in range(3):
            if rng.random() < 0.5:
                raw, lab = np.flip(raw, ax), np.flip(lab, ax)
        return torch.from_numpy(raw.copy())[None], torch.from_numpy(lab.copy())[None]


class ConvBNReLU(nn.Sequential):
    def __init__(self, i, o):
        super().__init__(nn.Conv3d(i, o, 3, padding=1, bias=False), nn.BatchNorm3d(o), nn.ReLU(inplace=True))


class VesselUNet(nn.Module):
    def __init__(self, f=(16, 32, 64, 128, 256)):
        super().__init__()
        self.enc = nn.ModuleList()
        prev = 1
        for c in f:
            self.enc.append(nn.Sequential(ConvBNReLU(prev, c), ConvBNReLU(c, c)))
            prev = c
        self.up = nn.ModuleList([nn.ConvTranspose3d(f[i], f[i - 1], 2, 2) for i in range(len(f) - 1, 0, -1)])
        self.dec = nn.ModuleList([nn.Sequential(ConvBNReLU(2 * f[i - 1], f[i - 1]), ConvBNReLU(f[i - 1], f[i - 1]))
                                  for i in range(len(f) - 1, 0, -1)])
        self.out = nn.Conv3d(f[0], 1, 1)

    def forward(self, x):
        skips = []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool3d(x, 2))
            skips.append(x)
        x = skips.pop()
        for u, d in zip(self.up, self.dec):
            x = d(torch.cat([u(x), skips.pop()], 1))
        return self.out(x)


def cldice_like_loss(logits, target):
    """BCE + soft Dice; thin vessels are dominated by background otherwise."""
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * target).sum() + 1) / (p.sum() + target.sum() + 1)
    return bce + dice


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    train_ds = VesselPatchSampler(cfg["train_volumes"], cfg["patch"], cfg["samples_per_epoch"],
                                  cfg["fg_fraction"], seed=0)
    val_ds = VesselPatchSampler(cfg["val_volumes"], cfg["patch"], cfg["val_patches"], cfg["fg_fraction"], seed=99)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), cfg["batch_size"], num_workers=4)

    model = VesselUNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    # lr in the config is for the global batch of 16 (8 GPUs x 2)
    lr = cfg["lr"] * world * cfg["batch_size"] / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"])
    steps = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg["amp"])

    start = 0
    if cfg["resume"]:
        ck = torch.load(cfg["resume"], map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1
    out = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    log.info("world %d, %d steps/epoch, lr %.2e", world, len(train_dl), lr)

    best = 0.0
    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                loss = cldice_like_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        model.eval()
        st = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.float16, enabled=cfg["amp"]):
                    pred = model.module(x) > 0
                st[0] += (pred & (y > 0)).sum()
                st[1] += pred.sum()
                st[2] += (y > 0).sum()
        dist.all_reduce(loss_acc)
        dist.all_reduce(st)
        dice = (2 * st[0] / (st[1] + st[2]).clamp(min=1)).item()
        log.info("epoch %d loss %.4f val dice %.4f (%.0fs)", epoch, (loss_acc[0] / loss_acc[1]).item(),
                 dice, time.time() - t0)

        if rank == 0:
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "scaler": scaler.state_dict(), "epoch": epoch, "dice": dice}
            torch.save(ck, os.path.join(out, "last.pt"))
            if dice > best:
                best = dice
                torch.save(ck, os.path.join(out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
