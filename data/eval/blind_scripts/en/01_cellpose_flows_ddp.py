#!/usr/bin/env python
"""
Cellpose-style flow training on the facility's annotated cyto/nuclei sets.

Every training image is a 2-channel TIFF (cyto, nuclei) with a matching
``*_flows.tif`` written by ``make_flows.py`` (channels: cell probability,
dy, dx).  Random 224x224 tiles are cut on the fly and each tile is normalised
to its own 1st/99th percentile.

    torchrun --standalone --nproc_per_node=4 01_cellpose_flows_ddp.py \
        --data /srv/imaging/cellpose_train --out /srv/imaging/runs/cp_flows

Imaging Core Facility - segmentation group
"""
import argparse
import glob
import json
import logging
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("cp_flows")


def parse_args():
    p = argparse.ArgumentParser(description="cellpose-style flow training")
    p.add_argument("--data", required=True, help="folder with *_img.tif / *_flows.tif")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (all GPUs)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--tile", type=int, default=224)
    p.add_argument("--tiles-per-image", type=int, default=8)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--nbase", type=int, nargs="+", default=[32, 64, 128, 256])
    return p.parse_args()


def normalize_tile(x, lo=1.0, hi=99.0):
    """per-channel percentile normalisation, as in cellpose"""
    out = np.empty_like(x, dtype=np.float32)
    for c in range(x.shape[0]):
        p1, p99 = np.percentile(x[c], [lo, hi])
        out[c] = (x[c] - p1) / max(p99 - p1, 1e-3)
    return out


class FlowTiles(Dataset):
    def __init__(self, files, tile=224, tiles_per_image=8, augment=True):
        self.files = files
        self.tile = tile
        self.tiles_per_image = tiles_per_image
        self.augment = augment

    def __len__(self):
        return len(self.files) * self.tiles_per_image

    def __getitem__(self, idx):
        f = self.files[idx // self.tiles_per_image]
        img = tifffile.imread(f).astype(np.float32)          # (2, H, W)
        flows = tifffile.imread(f.replace("_img.tif", "_flows.tif")).astype(np.float32)  # (3, H, W)
        _, H, W = img.shape
        t = self.tile
        y = np.random.randint(0, max(H - t, 0) + 1)
        x = np.random.randint(0, max(W - t, 0) + 1)
        img = img[:, y:y + t, x:x + t]
        flows = flows[:, y:y + t, x:x + t]
        if self.augment:
            if np.random.rand() < 0.5:
                img = img[:, :, ::-1]
                flows = flows[:, :, ::-1].copy()
                flows[2] *= -1  # dx flips sign
            if np.random.rand() < 0.5:
                img = img[:, ::-1, :]
                flows = flows[:, ::-1, :].copy()
                flows[1] *= -1  # dy flips sign
        img = normalize_tile(np.ascontiguousarray(img))
        return torch.from_numpy(img), torch.from_numpy(np.ascontiguousarray(flows))


def conv_block(cin, cout):
    return nn.Sequential(
        nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, 3, padding=1),
        nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1),
    )


class FlowNet(nn.Module):
    """small residual U-Net with a global style vector (cellpose-like)"""

    def __init__(self, nchan=2, nout=3, nbase=(32, 64, 128, 256)):
        super().__init__()
        chans = [nchan] + list(nbase)
        self.down = nn.ModuleList([conv_block(chans[i], chans[i + 1]) for i in range(len(nbase))])
        self.skip = nn.ModuleList([nn.Conv2d(chans[i], chans[i + 1], 1) for i in range(len(nbase))])
        self.style = nn.Linear(nbase[-1], nbase[-1])
        self.up = nn.ModuleList()
        for i in range(len(nbase) - 1, 0, -1):
            self.up.append(conv_block(nbase[i] + nbase[i - 1], nbase[i - 1]))
        self.head = nn.Conv2d(nbase[0], nout, 1)

    def forward(self, x):
        feats = []
        for i, (blk, sk) in enumerate(zip(self.down, self.skip)):
            if i > 0:
                x = F.max_pool2d(x, 2)
            x = blk(x) + sk(x)
            feats.append(x)
        style = F.normalize(self.style(x.mean(dim=(2, 3))), dim=1)
        x = x + style[:, :, None, None]
        for blk, f in zip(self.up, reversed(feats[:-1])):
            x = F.interpolate(x, size=f.shape[-2:], mode="nearest")
            x = blk(torch.cat([x, f], dim=1))
        return self.head(x)


def flow_loss(pred, target):
    # flows are scaled by 5 like in cellpose so that the MSE term is not negligible
    l_flow = F.mse_loss(pred[:, 1:], 5.0 * target[:, 1:])
    l_prob = F.binary_cross_entropy_with_logits(pred[:, 0], (target[:, 0] > 0.5).float())
    return l_flow + l_prob


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    stats = torch.zeros(2, device=device)
    for img, flows in loader:
        img, flows = img.to(device, non_blocking=True), flows.to(device, non_blocking=True)
        pred = net(img)
        stats[0] += flow_loss(pred, flows) * img.shape[0]
        stats[1] += img.shape[0]
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")

    files = sorted(glob.glob(os.path.join(args.data, "*_img.tif")))
    n_val = max(1, len(files) // 10)
    val_files, train_files = files[:n_val], files[n_val:]
    log.info("%d train / %d val images, world size %d", len(train_files), len(val_files), world_size)

    train_ds = FlowTiles(train_files, args.tile, args.tiles_per_image, augment=True)
    val_ds = FlowTiles(val_files, args.tile, 4, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    per_gpu = args.batch_size // world_size
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=per_gpu, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    net = FlowNet(nchan=2, nout=3, nbase=args.nbase)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                          weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as fh:
            json.dump(vars(args), fh, indent=2)

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(1, device=device)
        for step, (img, flows) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            flows = flows.to(device, non_blocking=True)
            pred = model(img)
            loss = flow_loss(pred, flows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.detach()
        sched.step()
        dist.all_reduce(running)
        train_loss = running.item() / (world_size * max(len(train_loader), 1))
        log.info("epoch %d  loss %.4f  lr %.4f  %.1fs", epoch, train_loss,
                 sched.get_last_lr()[0], time.time() - t0)

        if (epoch + 1) % args.val_every == 0 or epoch == args.epochs - 1:
            val_loss = validate(model.module, val_loader, device)
            log.info("epoch %d  val loss %.4f", epoch, val_loss)
            if rank == 0:
                state = {"epoch": epoch, "model": model.module.state_dict(),
                         "opt": opt.state_dict(), "val_loss": val_loss, "nbase": args.nbase}
                torch.save(state, os.path.join(args.out, "last.pt"))
                if val_loss < best:
                    best = val_loss
                    torch.save(state, os.path.join(args.out, "best.pt"))
            dist.barrier()

    log.info("done, best val loss %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
