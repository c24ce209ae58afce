"""Event landslide mapping: pre/post Sentinel-2 + SRTM slope / aspect.

Channels: 4 bands (B2, B3, B4, B8) pre, same post, NDVI pre/post, slope, aspect -> 12.
Training events: Hokkaido 2018, Gorkha 2015, Haiti 2021, Wenchuan aftershocks;
validation event: Kaikoura 2016 (different country and geology on purpose).

    torchrun --nproc_per_node=4 19_landslide_cd_dem.py --data /srv/eo/landslide_chips --epochs 120
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

import segmentation_models_pytorch as smp

TRAIN_EVENTS = ["hokkaido_2018", "gorkha_2015", "haiti_2021", "wenchuan_2008"]
VAL_EVENTS = ["kaikoura_2016"]
IN_CH = 12
logger = logging.getLogger("landslide")


def build_input(z):
    pre, post = z["pre"].astype(np.float32) / 1e4, z["post"].astype(np.float32) / 1e4
    ndvi = lambda s: (s[3] - s[2]) / (s[3] + s[2] + 1e-6)
    slope = z["slope"].astype(np.float32)[None] / 90.0
    aspect = z["aspect"].astype(np.float32)[None] / 360.0
    return np.concatenate([pre, post, ndvi(pre)[None], ndvi(post)[None], slope, aspect], 0)


class LandslideChips(Dataset):
    def __init__(self, root, events, augment):
        self.files = []
        for ev in events:
            with open(os.path.join(root, ev, "chips.json")) as f:
                self.files += [os.path.join(root, ev, c) for c in json.load(f)]
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        x, y = build_input(z), z["mask"].astype(np.float32)
        if self.augment:
            # no rotations: aspect is tied to the north-up grid
            if np.random.rand() < 0.3:
                x[:8] *= np.random.uniform(0.9, 1.1)
        return torch.from_numpy(x), torch.from_numpy(y)[None]


def focal_dice(logits, y, alpha=0.75, gamma=2.0):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    pt = p * y + (1 - p) * (1 - y)
    focal = (alpha * y + (1 - alpha) * (1 - y)) * (1 - pt) ** gamma * ce
    dice = 1 - (2 * (p * y).sum() + 1) / (p.sum() + y.sum() + 1)
    return focal.mean() + dice


def train_one_epoch(model, loader, opt, sched, device, epoch, rank):
    model.train()
    acc = torch.zeros(2, device=device)
    t0 = time.time()
    for it, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = focal_dice(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        if rank == 0 and it % 20 == 0:
            logger.info("epoch %d it %d/%d loss %.4f", epoch, it, len(loader), loss.item())
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item(), time.time() - t0


@torch.no_grad()
def evaluate(net, loader, device, thr=0.5):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        p = torch.sigmoid(net(x)) > thr
        t = y > 0.5
        s += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
    dist.all_reduce(s)
    tp, fp, fn = s.tolist()
    prec, rec = tp / max(1.0, tp + fp), tp / max(1.0, tp + fn)
    return {"precision": prec, "recall": rec, "f1": 2 * prec * rec / max(1e-9, prec + rec),
            "iou": tp / max(1.0, tp + fp + fn)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/landslide")
    ap.add_argument("--encoder", default="resnet50")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4, help="for a global batch of 64")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)

    train_ds = LandslideChips(args.data, TRAIN_EVENTS, augment=True)
    val_ds = LandslideChips(args.data, VAL_EVENTS, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.batch_size,
                            num_workers=6, pin_memory=True)

    net = smp.DeepLabV3Plus(args.encoder, encoder_weights=None, in_channels=IN_CH, classes=1)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("%d train chips (%s), %d val chips (%s), lr %.2e", len(train_ds), ",".join(TRAIN_EVENTS),
                    len(val_ds), ",".join(VAL_EVENTS), lr)

    best_iou = 0.0
    for epoch in range(args.epochs):
        train_loss, dt = train_one_epoch(model, train_loader, opt, sched, device, epoch, rank)
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            m = evaluate(net, val_loader, device)
            if rank == 0:
                logger.info("epoch %d loss %.4f (%.0fs) | val P %.3f R %.3f F1 %.3f IoU %.3f", epoch, train_loss, dt,
                            m["precision"], m["recall"], m["f1"], m["iou"])
                if m["iou"] > best_iou:
                    best_iou = m["iou"]
                    torch.save({"model": net.state_dict(), "epoch": epoch, "iou": best_iou},
                               os.path.join(args.out, "best.pt"))
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
