#!/usr/bin/env python
"""
BigEarthNet-S2 (v2, 19-class nomenclature) multi-label scene classification with a
12-band ResNet-50 from timm.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_id=ben19 --rdzv_backend=c10d \
        --rdzv_endpoint=gpu-node01:29400 06_bigearthnet_multilabel.py \
        --lmdb /lustre/datasets/BigEarthNet-V2/encoded.lmdb \
        --meta /lustre/datasets/BigEarthNet-V2/metadata.parquet --out /lustre/runs/ben19_r50
"""
import argparse
import json
import os
import time

import lmdb
import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.numpy import load as st_load
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BANDS_10M = ["B02", "B03", "B04", "B08"]
BANDS_20M = ["B05", "B06", "B07", "B8A", "B11", "B12"]
BANDS_60M = ["B01", "B09"]
ALL_BANDS = BANDS_10M + BANDS_20M + BANDS_60M

LABELS_19 = [
    "Urban fabric", "Industrial or commercial units", "Arable land", "Permanent crops", "Pastures",
    "Complex cultivation patterns", "Land principally occupied by agriculture, with significant areas of natural vegetation",
    "Agro-forestry areas", "Broad-leaved forest", "Coniferous forest", "Mixed forest",
    "Natural grassland and sparsely vegetated areas", "Moors, heathland and sclerophyllous vegetation",
    "Transitional woodland, shrub", "Beaches, dunes, sands", "Inland wetlands", "Coastal wetlands",
    "Inland waters", "Marine waters",
]
LABEL_TO_IDX = {name: i for i, name in enumerate(LABELS_19)}


class BigEarthNetLMDB(Dataset):
    def __init__(self, lmdb_path, meta, split, train):
        df = meta[meta["split"] == split].reset_index(drop=True)
        self.keys = df["patch_id"].tolist()
        self.targets = np.zeros((len(df), len(LABELS_19)), dtype=np.float32)
        for i, labels in enumerate(df["labels"]):
            for name in labels:
                self.targets[i, LABEL_TO_IDX[name]] = 1.0
        self.lmdb_path = lmdb_path
        self.train = train
        self.env = None

    def __len__(self):
        return len(self.keys)

    def _read(self, key):
        if self.env is None:
            self.env = lmdb.open(self.lmdb_path, readonly=True, lock=False, readahead=False, max_readers=512)
        with self.env.begin() as txn:
            arrays = st_load(txn.get(key.encode()))
        planes = []
        for b in ALL_BANDS:
            x = torch.from_numpy(arrays[b].astype(np.float32))[None, None]
            if x.shape[-1] != 120:
                x = F.interpolate(x, size=(120, 120), mode="bilinear", align_corners=False)
            planes.append(x[0, 0])
        return torch.stack(planes)

    def __getitem__(self, i):
        img = self._read(self.keys[i])
        img = torch.log1p(img) / 10.0
        if self.train:
            if torch.rand(1).item() < 0.5:
                img = img.flip(-1)
            if torch.rand(1).item() < 0.5:
                img = img.flip(-2)
        return img, torch.from_numpy(self.targets[i])


@torch.no_grad()
def evaluate(model, loader, device, threshold=0.5):
    model.eval()
    scores, targets = [], []
    for img, y in loader:
        logits = model(img.to(device, non_blocking=True))
        scores.append(torch.sigmoid(logits).float().cpu())
        targets.append(y)
    scores = torch.cat(scores).numpy()
    targets = torch.cat(targets).numpy()
    pred = scores >= threshold
    tp = float((pred & (targets > 0.5)).sum())
    fp = float((pred & (targets < 0.5)).sum())
    fn = float((~pred & (targets > 0.5)).sum())
    counts = torch.tensor([tp, fp, fn], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    tp, fp, fn = counts.tolist()
    micro_f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
    precision = tp / max(tp + fp, 1.0)
    recall = tp / max(tp + fn, 1.0)
    model.train()
    return micro_f1, precision, recall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmdb", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0

    meta = pd.read_parquet(args.meta)
    meta = meta[~meta["contains_seasonal_snow"] & ~meta["contains_cloud_or_shadow"]]
    train_ds = BigEarthNetLMDB(args.lmdb, meta, "train", train=True)
    val_ds = BigEarthNetLMDB(args.lmdb, meta, "validation", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    # contiguous, non-overlapping shards so no validation patch is counted twice
    val_idx = np.array_split(np.arange(len(val_ds)), world)[rank]
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, val_idx.tolist()), 256, shuffle=False, num_workers=args.workers,
                        pin_memory=True)

    model = timm.create_model(args.arch, pretrained=False, in_chans=len(ALL_BANDS), num_classes=len(LABELS_19))
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    if main_proc:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)}  val {len(val_ds)}  world {world}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        run_loss = torch.zeros(1, device=device)
        for it, (img, y) in enumerate(train_dl):
            img = img.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run_loss += loss.detach()
        dist.all_reduce(run_loss)
        run_loss /= world * len(train_dl)

        f1, prec, rec_ = evaluate(model.module, val_dl, device)
        if main_proc:
            rec = {"epoch": epoch, "loss": run_loss.item(), "micro_f1": f1, "precision": prec, "recall": rec_,
                   "sec": time.time() - t0}
            print(json.dumps(rec), flush=True)
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
