#!/usr/bin/env python3
"""Bi-temporal Sentinel-2 change detection (early-fusion U-Net).

Patches are pre-cut from L2A tiles by tools/cut_patches.py into
<root>/<split>/<mgrs_tile>/<patch_id>.npz with keys:
    t1, t2 : (13, H, W) uint16 surface reflectance
    change : (H, W) uint8, 0/1, 255 = nodata / cloud / cloud shadow
Train and val splits are different MGRS tiles (no spatial overlap).
"""
import argparse
import glob
import json
import logging
import math
import os
import time

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255
S2_BANDS = 13

log = logging.getLogger("s2cd")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/s2cd/patches")
    p.add_argument("--out-dir", default="runs/s2cd")
    p.add_argument("--encoder", default="resnet34")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4, help="for a global batch of 128")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--min-valid-frac", type=float, default=0.2)
    p.add_argument("--change-weight", type=float, default=5.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--resume", default="")
    return p.parse_args()


class S2ChangePatches(Dataset):
    def __init__(self, root, split, train):
        self.files = sorted(glob.glob(os.path.join(root, split, "*", "*.npz")))
        if not self.files:
            raise FileNotFoundError(f"no patches under {root}/{split}")
        with open(os.path.join(root, "band_stats.json")) as f:
            stats = json.load(f)
        self.mean = np.asarray(stats["mean"], dtype=np.float32)[:, None, None]
        self.std = np.asarray(stats["std"], dtype=np.float32)[:, None, None]
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        t1 = (d["t1"].astype(np.float32) - self.mean) / self.std
        t2 = (d["t2"].astype(np.float32) - self.mean) / self.std
        y = d["change"].astype(np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                t1, t2, y = t1[:, :, ::-1], t2[:, :, ::-1], y[:, ::-1]
            if np.random.rand() < 0.5:
                t1, t2, y = t1[:, ::-1], t2[:, ::-1], y[::-1]
            k = np.random.randint(4)
            t1, t2, y = np.rot90(t1, k, (1, 2)), np.rot90(t2, k, (1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                # date swap: change is symmetric
                t1, t2 = t2, t1
        x = np.concatenate([t1, t2], 0)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def cosine_with_warmup(optimizer, warmup_steps, total_steps):
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def train_one_epoch(model, loader, criterion, optimizer, scheduler, device, epoch, args, rank):
    model.train()
    running = torch.zeros(2, device=device)  # loss sum, steps
    skipped = 0
    t0 = time.time()
    for step, (x, y) in enumerate(loader):
        valid_frac = (y != IGNORE).float().mean().item()
        if valid_frac < args.min_valid_frac:
            # mostly cloud / nodata, nothing useful to learn from
            skipped += 1
            continue
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)

        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(x)
        loss = criterion(logits.float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        running += torch.stack([loss.detach(), torch.ones((), device=device)])
        if rank == 0 and step % 50 == 0:
            log.info("epoch %d step %d/%d loss %.4f lr %.2e (%.1fs)", epoch, step, len(loader),
                     loss.item(), scheduler.get_last_lr()[0], time.time() - t0)
    dist.all_reduce(running)
    return (running[0] / running[1].clamp(min=1)).item(), skipped


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(2, 2, dtype=torch.long, device=device)
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        m = y != IGNORE
        conf += torch.bincount(y[m] * 2 + pred[m], minlength=4).view(2, 2)
    dist.all_reduce(conf, op=dist.ReduceOp.SUM)
    tp, fp, fn = conf[1, 1].item(), conf[0, 1].item(), conf[1, 0].item()
    prec = tp / max(1, tp + fp)
    rec = tp / max(1, tp + fn)
    f1 = 2 * prec * rec / max(1e-9, prec + rec)
    iou = tp / max(1, tp + fp + fn)
    return {"precision": prec, "recall": rec, "f1": f1, "iou": iou}


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)
    torch.backends.cudnn.benchmark = True

    train_ds = S2ChangePatches(args.data_root, "train", train=True)
    val_ds = S2ChangePatches(args.data_root, "val", train=False)
    # strided shard of the val patches, no padding duplicates
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights=None, in_channels=2 * S2_BANDS, classes=2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = cosine_with_warmup(optimizer, args.warmup_epochs * len(train_loader), total_steps)

    start_epoch, best_f1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_f1 = ckpt["epoch"] + 1, ckpt["best_f1"]

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, args.change_weight], device=device),
                                    ignore_index=IGNORE)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        log.info("train %d patches, val %d patches, world %d, lr %.2e",
                 len(train_ds), len(val_ds), world_size, lr)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss, skipped = train_one_epoch(model, train_loader, criterion, optimizer,
                                              scheduler, device, epoch, args, rank)
        metrics = evaluate(model.module, val_loader, device)
        if rank == 0:
            log.info("epoch %d train_loss %.4f skipped %d | val %s", epoch, train_loss, skipped,
                     " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_f1": max(best_f1, metrics["f1"]),
                "args": vars(args),
            }
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if metrics["f1"] > best_f1:
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        best_f1 = max(best_f1, metrics["f1"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
