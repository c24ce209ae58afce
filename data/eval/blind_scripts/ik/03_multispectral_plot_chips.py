"""Soybean maturity-stage classification from 5-band UAV orthomosaics.

Plot boundaries come from the trial's shapefile; each plot is clipped from the
MicaSense orthomosaic (B, G, R, RedEdge, NIR), resampled to a fixed chip size
and cached as one .npz per flight, so later runs skip the rasterio step.

    torchrun --nnodes=1 --nproc_per_node=4 03_multispectral_plot_chips.py \
        --flights /data/soy2023/flights.csv --plots /data/soy2023/plots.shp --cache-dir /data/soy2023/cache
"""
import argparse
import os
import time
from pathlib import Path

import geopandas as gpd
import numpy as np
import pandas as pd
import rasterio
import rasterio.mask
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

N_BANDS = 5
STAGES = ["R5", "R6", "R7", "R8"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--flights", required=True, help="csv: flight_id,date,ortho_path,split")
    p.add_argument("--plots", required=True)
    p.add_argument("--labels", default=None, help="csv: flight_id,plot_id,stage (default: next to flights)")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--chip", type=int, default=64)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--logdir", default="runs/maturity")
    return p.parse_args()


def clip_plots(ortho_path, plots, chip):
    """Return (n_plots, 5, chip, chip) float32 reflectance chips, one per polygon."""
    chips = []
    with rasterio.open(ortho_path) as src:
        plots = plots.to_crs(src.crs)
        for geom in plots.geometry:
            arr, _ = rasterio.mask.mask(src, [geom], crop=True, filled=True, nodata=0)
            t = torch.from_numpy(arr[:N_BANDS].astype(np.float32))[None]
            t = F.interpolate(t, size=(chip, chip), mode="bilinear", align_corners=False)[0]
            chips.append(t.numpy())
    return np.stack(chips) / 65535.0


def load_flight(row, plots, cache_dir, chip):
    cache_path = Path(cache_dir) / f"{row.flight_id}_{chip}.npz"
    if not cache_path.exists():
        chips = clip_plots(row.ortho_path, plots, chip)
        np.savez(cache_path, chips=chips, plot_id=plots["plot_id"].values)
    data = np.load(cache_path)
    return data["chips"], data["plot_id"]


class ChipDataset(Dataset):
    def __init__(self, chips, labels, train):
        self.chips = chips
        self.labels = labels
        self.train = train
        # per-band stats from the training chips
        self.mean = chips.mean(axis=(0, 2, 3))[:, None, None]
        self.std = chips.std(axis=(0, 2, 3))[:, None, None] + 1e-6

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = (self.chips[i] - self.mean) / self.std
        x = torch.from_numpy(x.astype(np.float32))
        if self.train:
            if torch.rand(1) < 0.5:
                x = x.flip(2)
            if torch.rand(1) < 0.5:
                x = x.flip(1)
            x = torch.rot90(x, int(torch.randint(0, 4, (1,))), dims=(1, 2))
            # per-band gain jitter, mimics calibration panel drift between flights
            x = x * (1 + 0.05 * torch.randn(N_BANDS, 1, 1))
        return x, self.labels[i]


def build_split(args, split, plots, stage_df):
    flights = pd.read_csv(args.flights)
    chips, labels = [], []
    for row in flights[flights.split == split].itertuples():
        c, pid = load_flight(row, plots, args.cache_dir, args.chip)
        lab = stage_df[stage_df.flight_id == row.flight_id].set_index("plot_id")["stage"]
        keep = np.isin(pid, lab.index.values)
        chips.append(c[keep])
        labels.append(np.array([STAGES.index(s) for s in lab.loc[pid[keep]].values]))
    return np.concatenate(chips), np.concatenate(labels)


def make_model():
    m = torchvision.models.resnet18(weights=None, num_classes=len(STAGES))
    m.conv1 = nn.Conv2d(N_BANDS, 64, 3, 1, 1, bias=False)  # small chips: no stride-2 stem
    m.maxpool = nn.Identity()
    return m


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.cache_dir, exist_ok=True)

    plots = gpd.read_file(args.plots)
    labels_csv = args.labels or str(Path(args.flights).with_name("stages.csv"))
    stage_df = pd.read_csv(labels_csv)
    tr_x, tr_y = build_split(args, "train", plots, stage_df)
    va_x, va_y = build_split(args, "val", plots, stage_df)

    train_ds = ChipDataset(tr_x, tr_y, train=True)
    val_ds = ChipDataset(va_x, va_y, train=False)
    val_ds.mean, val_ds.std = train_ds.mean, train_ds.std

    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 256, shuffle=False, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.15)
    class_w = torch.tensor(len(tr_y) / (len(STAGES) * np.bincount(tr_y, minlength=len(STAGES)).clip(1)),
                           dtype=torch.float32, device=device)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=class_w, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        if rank == 0:
            # val set is a few thousand chips: score it whole on rank 0
            net = model.module
            net.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in val_loader:
                    x, y = x.to(device), y.to(device)
                    correct += (net(x).argmax(1) == y).sum().item()
                    total += y.numel()
            acc = correct / total
            writer.add_scalar("train/loss", (loss_sum[0] / loss_sum[1]).item(), epoch)
            writer.add_scalar("val/acc", acc, epoch)
            writer.add_scalar("lr", sched.get_last_lr()[0], epoch)
            print(f"epoch {epoch:3d}  val acc {acc:.4f}  {time.time() - t0:.1f}s", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "mean": train_ds.mean, "std": train_ds.std,
                            "epoch": epoch, "acc": acc}, Path(args.logdir) / "best.pt")
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
