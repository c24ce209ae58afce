"""Dynamic-World-style 9-class land cover from Sentinel-2 tiles with HF Accelerate.

Tiles: <data>/tiles/*.tif (9 bands: B2,B3,B4,B5,B6,B7,B8,B11,B12, uint16)
Labels: <data>/labels/*.tif (uint8, 0..8, 255 = unlabelled)
Split:  <data>/split.json  {"train": [...ids], "val": [...ids]}

Per-band robust statistics (2nd/98th percentile of log reflectance) are computed
once and written to <data>/stats/band_stats.json.

    accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 \
        11_landcover_accelerate.py --data /shared/dw_tiles --output /shared/runs/dw_segformer
"""
import argparse
import json
import math
import os

import numpy as np
import rasterio
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, Dataset
from transformers import SegformerConfig, SegformerForSemanticSegmentation, get_cosine_schedule_with_warmup

CLASSES = ["water", "trees", "grass", "flooded_vegetation", "crops",
           "shrub_and_scrub", "built", "bare", "snow_and_ice"]
IGNORE = 255


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="per device")
    p.add_argument("--lr", type=float, default=6e-5, help="for a global batch of 64")
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def compute_band_stats(data_dir, ids, n_tiles=400, seed=0):
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(ids), size=min(n_tiles, len(ids)), replace=False)
    samples = []
    for i in pick:
        with rasterio.open(os.path.join(data_dir, "tiles", f"{ids[i]}.tif")) as src:
            arr = src.read(out_shape=(src.count, 64, 64)).astype(np.float32)
        samples.append(np.log1p(arr.reshape(arr.shape[0], -1)))
    allpx = np.concatenate(samples, 1)
    lo, hi = np.percentile(allpx, [2, 98], axis=1)
    return {"lo": lo.tolist(), "hi": hi.tolist()}


def load_band_stats(data_dir, train_ids):
    path = os.path.join(data_dir, "stats", "band_stats.json")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        stats = compute_band_stats(data_dir, train_ids)
        with open(path + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(path + ".tmp", path)
    with open(path) as f:
        return json.load(f)


class DWTiles(Dataset):
    def __init__(self, data_dir, ids, stats, train):
        self.data_dir, self.ids, self.train = data_dir, ids, train
        self.lo = np.asarray(stats["lo"], np.float32)[:, None, None]
        self.hi = np.asarray(stats["hi"], np.float32)[:, None, None]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        tid = self.ids[i]
        with rasterio.open(os.path.join(self.data_dir, "tiles", f"{tid}.tif")) as src:
            x = np.log1p(src.read().astype(np.float32))
        with rasterio.open(os.path.join(self.data_dir, "labels", f"{tid}.tif")) as src:
            y = src.read(1).astype(np.int64)
        x = np.clip((x - self.lo) / (self.hi - self.lo), 0, 1) * 2 - 1
        if self.train:
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
        return {"pixel_values": torch.from_numpy(x.copy()), "labels": torch.from_numpy(y.copy())}


def per_sample_confusion(logits, labels, n):
    pred = F.interpolate(logits, size=labels.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
    b = labels.shape[0]
    valid = labels != IGNORE
    idx = (labels * n + pred).masked_fill(~valid, n * n)           # invalid -> overflow bin
    offs = torch.arange(b, device=labels.device)[:, None, None] * (n * n + 1)
    counts = torch.bincount((idx + offs).flatten(), minlength=b * (n * n + 1))
    return counts.view(b, n * n + 1)[:, : n * n]


def main():
    args = parse_args()
    project = ProjectConfiguration(project_dir=args.output, automatic_checkpoint_naming=True,
                                   total_limit=3)
    accelerator = Accelerator(log_with="tensorboard", project_config=project)
    set_seed(args.seed)
    n = len(CLASSES)

    with open(os.path.join(args.data, "split.json")) as f:
        split = json.load(f)
    with accelerator.main_process_first():
        stats = load_band_stats(args.data, split["train"])

    train_ds = DWTiles(args.data, split["train"], stats, train=True)
    val_ds = DWTiles(args.data, split["val"], stats, train=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=8)

    config = SegformerConfig.from_pretrained("nvidia/mit-b2", num_channels=9, num_labels=n,
                                             id2label=dict(enumerate(CLASSES)),
                                             label2id={c: i for i, c in enumerate(CLASSES)},
                                             semantic_loss_ignore_index=IGNORE)
    model = SegformerForSemanticSegmentation(config)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    lr = args.lr * args.batch_size * accelerator.num_processes / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    model, optimizer, train_dl, val_dl = accelerator.prepare(model, optimizer, train_dl, val_dl)
    # len(train_dl) is per process now; the prepared scheduler is stepped once per process
    # on every optimizer step, so the schedule is expressed in num_processes * steps
    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch * accelerator.num_processes
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    scheduler = accelerator.prepare(scheduler)

    accelerator.init_trackers("dw_segformer", config={k: v for k, v in vars(args).items()})
    start_epoch = 0
    if args.resume:
        ckpts = sorted(os.listdir(os.path.join(args.output, "checkpoints")),
                       key=lambda s: int(s.split("_")[-1]))
        accelerator.load_state(os.path.join(args.output, "checkpoints", ckpts[-1]))
        start_epoch = int(ckpts[-1].split("_")[-1]) + 1
        project.iteration = start_epoch
        accelerator.print(f"resumed from {ckpts[-1]}")

    best_miou = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_dl.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            out = model(pixel_values=batch["pixel_values"], labels=batch["labels"])
            accelerator.backward(out.loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step % 50 == 0:
                accelerator.log({"train/loss": out.loss.item(), "train/lr": scheduler.get_last_lr()[0]},
                                step=epoch * steps_per_epoch + step)

        model.eval()
        cm = torch.zeros(n * n, dtype=torch.long, device=accelerator.device)
        for batch in val_dl:
            with torch.no_grad():
                logits = model(pixel_values=batch["pixel_values"]).logits
            per_sample = per_sample_confusion(logits, batch["labels"], n)
            cm += accelerator.gather_for_metrics(per_sample).sum(0)
        cm = cm.view(n, n).double()
        inter = cm.diag()
        iou = inter / (cm.sum(0) + cm.sum(1) - inter).clamp(min=1)
        miou = iou.mean().item()
        accelerator.log({"val/mIoU": miou, **{f"val/iou_{c}": v for c, v in zip(CLASSES, iou.tolist())}},
                        step=(epoch + 1) * steps_per_epoch)
        accelerator.print(f"epoch {epoch}: mIoU {miou:.4f}")

        accelerator.save_state()
        if miou > best_miou:
            best_miou = miou
            accelerator.wait_for_everyone()
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(os.path.join(args.output, "best"),
                                      is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)

    accelerator.end_training()


if __name__ == "__main__":
    main()
