"""Rooftop PV segmentation from 0.3 m aerial orthophotos (RGB).

The encoder is ImageNet pre-trained and fine-tuned with a lower learning rate
than the freshly initialised decoder and head.

    torchrun --nproc_per_node=4 13_solar_panel_segmentation.py \
        --data-dir /scratch/shared/pv_ortho --out-dir /scratch/shared/pv_runs/fpn_r50
"""
import argparse
import json
import os
import random
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--arch", default="FPN")
    ap.add_argument("--encoder", default="resnet50")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3, help="decoder lr for the global batch of 64")
    ap.add_argument("--encoder-lr-mult", type=float, default=0.1)
    ap.add_argument("--pos-frac", type=float, default=0.5,
                    help="fraction of training tiles drawn from tiles that contain PV")
    return ap.parse_args()


class OrthoTiles(Dataset):
    def __init__(self, data_dir, split, augment):
        with open(os.path.join(data_dir, f"{split}.json")) as f:
            self.items = json.load(f)       # [{"id": ..., "has_pv": bool}, ...]
        self.data_dir, self.augment = data_dir, augment

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        tid = self.items[i]["id"]
        with rasterio.open(os.path.join(self.data_dir, "img", f"{tid}.tif")) as src:
            img = src.read([1, 2, 3]).astype(np.float32) / 255.0
        with rasterio.open(os.path.join(self.data_dir, "mask", f"{tid}.tif")) as src:
            mask = (src.read(1) > 0).astype(np.float32)
        if self.augment:
            k = random.randint(0, 3)
            img, mask = np.rot90(img, k, (1, 2)), np.rot90(mask, k)
            if random.random() < 0.5:
                img, mask = img[:, :, ::-1], mask[:, ::-1]
            img = img * random.uniform(0.85, 1.15)             # exposure jitter
        img = (img - IMAGENET_MEAN) / IMAGENET_STD
        return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.ascontiguousarray(mask))


class BalancedDistributedSampler(DistributedSampler):
    """DistributedSampler over a fixed-length epoch that over-samples PV tiles."""

    def __init__(self, dataset, pos_frac, **kw):
        super().__init__(dataset, **kw)
        has_pv = np.array([it["has_pv"] for it in dataset.items])
        self.pos = np.flatnonzero(has_pv)
        self.neg = np.flatnonzero(~has_pv)
        self.pos_frac = pos_frac

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        n_pos = int(self.total_size * self.pos_frac)
        idx = np.concatenate([rng.choice(self.pos, n_pos, replace=True),
                              rng.choice(self.neg, self.total_size - n_pos, replace=True)])
        rng.shuffle(idx)
        return iter(idx[self.rank:self.total_size:self.num_replicas].tolist())


def build_model(args):
    return getattr(smp, args.arch)(encoder_name=args.encoder, encoder_weights="imagenet",
                                   in_channels=3, classes=1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    # download the encoder weights once, then let the other ranks read them from the hub cache
    if rank == 0:
        model = build_model(args)
    dist.barrier()
    if rank != 0:
        model = build_model(args)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = OrthoTiles(args.data_dir, "train", augment=True)
    val_ds = OrthoTiles(args.data_dir, "val", augment=False)
    sampler = BalancedDistributedSampler(train_ds, args.pos_frac, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=32, num_workers=8, pin_memory=True)

    lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.AdamW([
        {"params": model.encoder.parameters(), "lr": lr * args.encoder_lr_mult},
        {"params": model.decoder.parameters(), "lr": lr},
        {"params": model.segmentation_head.parameters(), "lr": lr},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl),
                                                           eta_min=1e-6)
    loss_fn = smp.losses.DiceLoss("binary", from_logits=True)
    bce = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best_iou = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (img, mask) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True).unsqueeze(1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            logits = logits.float()
            loss = bce(logits, mask) + loss_fn(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        net = model.module
        net.eval()
        counts = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for img, mask in val_dl:
                img, mask = img.to(device), mask.to(device)
                pred = net(img)[:, 0] > 0
                gt = mask > 0.5
                counts += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum()]).double()
        dist.all_reduce(counts)
        tp, fp, fn = counts.tolist()
        iou = tp / max(tp + fp + fn, 1.0)
        f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val IoU {iou:.4f} F1 {f1:.4f}", flush=True)
            ckpt = {"epoch": epoch, "arch": args.arch, "encoder": args.encoder,
                    "model": net.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.out_dir, "last.pt"))
            if iou > best_iou:
                best_iou = iou
                torch.save(ckpt, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
