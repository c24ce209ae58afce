"""Cropland conversion detection (grassland/forest -> cropland) from Sentinel-2
growing-season composites of two years, US Midwest.

Index: a parquet with one row per 256 px chip (cog path, window, county FIPS).
Train / val split is by county so that neighbouring fields never straddle it.

    torchrun --nproc_per_node=8 16_cropland_conversion_wandb.py --index /data/cropconv/chips.parquet \
        --val-states 19,31 --run-name linknet-r34-v2
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import rasterio
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from rasterio.windows import Window
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BANDS = 10
CHIP = 256


class ChipIndexDataset(Dataset):
    def __init__(self, df, train):
        self.df = df.reset_index(drop=True)
        self.train = train

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        win = Window(int(r.col_off), int(r.row_off), CHIP, CHIP)
        with rasterio.open(r.cog_y1) as s:
            x1 = s.read(window=win, boundless=True, fill_value=0).astype(np.float32)
        with rasterio.open(r.cog_y2) as s:
            x2 = s.read(window=win, boundless=True, fill_value=0).astype(np.float32)
        with rasterio.open(r.label) as s:
            y = s.read(1, window=win, boundless=True, fill_value=255).astype(np.int64)
        x = np.concatenate([x1, x2], 0) / 3000.0
        if self.train:
            if np.random.rand() < 0.5:
                x, y = x[..., ::-1], y[..., ::-1]
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True)
    p.add_argument("--val-states", default="19,31", help="state FIPS prefixes held out")
    p.add_argument("--run-name", default=None)
    p.add_argument("--project", default="cropland-conversion")
    p.add_argument("--out", default="/data/cropconv/runs")
    p.add_argument("--encoder", default="resnet34")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 256")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    conf = torch.zeros(2, 2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        m = y != 255
        conf += torch.bincount(y[m] * 2 + pred[m], minlength=4).view(2, 2).double()
    dist.all_reduce(conf)
    tp, fp, fn = conf[1, 1].item(), conf[0, 1].item(), conf[1, 0].item()
    return {"val/precision": tp / max(1.0, tp + fp), "val/recall": tp / max(1.0, tp + fn),
            "val/f1": 2 * tp / max(1.0, 2 * tp + fp + fn), "val/iou": tp / max(1.0, tp + fp + fn)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.project, name=args.run_name, config={**vars(args), "world_size": world})

    df = pd.read_parquet(args.index)
    val_mask = df.county_fips.astype(str).str.zfill(5).str[:2].isin(args.val_states.split(","))
    train_ds = ChipIndexDataset(df[~val_mask], train=True)
    val_ds = ChipIndexDataset(df[val_mask], train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size,
                        num_workers=args.workers, pin_memory=True)

    net = smp.Linknet(args.encoder, encoder_weights=None, in_channels=2 * BANDS, classes=2)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    weight = torch.tensor([1.0, 6.0], device=device)

    run_dir = os.path.join(args.out, args.run_name or "default")
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)

    gstep, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, weight=weight, ignore_index=255)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            gstep += 1
            if gstep % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0], "epoch": epoch}, step=gstep)

        metrics = evaluate(net, val_dl, device)
        metrics["time/epoch_s"] = time.time() - t0
        wandb.log(metrics, step=gstep)
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(run_dir, "last.pt"))
            if metrics["val/f1"] > best:
                best = metrics["val/f1"]
                torch.save({"model": net.state_dict(), "epoch": epoch, "f1": best},
                           os.path.join(run_dir, "best.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
