"""Crop-type segmentation from multi-temporal Sentinel-2 composites.

Each patch stacks 6 monthly median composites (Apr-Sep) x 10 bands = 60 channels,
128x128 px at 10 m; labels are rasterised LPIS parcels (0 = background/unknown).

    torchrun --nproc_per_node=4 08_crop_type_patches.py --config configs/crops_de.yaml
"""
import argparse
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = {
    "data_root": "/srv/shared/lpis_de/patches",
    "out_dir": "/srv/shared/lpis_de/runs/tempcnn_unet",
    "classes": ["background", "winter_wheat", "winter_barley", "winter_rape", "maize",
                "sugar_beet", "potato", "spring_cereal", "grassland", "legumes"],
    "n_dates": 6,
    "n_bands": 10,
    "epochs": 50,
    "batch_size": 32,
    "lr": 1e-3,
    "workers": 8,
    "label_smoothing": 0.05,
}


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--lr", type=float)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for k in ("epochs", "lr"):
        if getattr(a, k) is not None:
            cfg[k] = getattr(a, k)
    return cfg


class CropPatches(Dataset):
    def __init__(self, root, split, stats, augment):
        self.dir = os.path.join(root, split)
        self.ids = sorted(f[:-8] for f in os.listdir(self.dir) if f.endswith("_img.tif"))
        self.mean = np.asarray(stats["mean"], np.float32)[:, None, None]
        self.std = np.asarray(stats["std"], np.float32)[:, None, None]
        self.augment = augment

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        pid = self.ids[i]
        with rasterio.open(os.path.join(self.dir, pid + "_img.tif")) as src:
            x = src.read().astype(np.float32)
        with rasterio.open(os.path.join(self.dir, pid + "_lbl.tif")) as src:
            y = src.read(1).astype(np.int64)
        x = (x - self.mean) / self.std
        if self.augment:
            if np.random.rand() < 0.5:
                x, y = x[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                x, y = x[..., ::-1, :], y[::-1, :]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


class TemporalEncoder(nn.Module):
    """Shared per-date 1x1 conv, then temporal attention pooling."""

    def __init__(self, n_dates, n_bands, dim=64):
        super().__init__()
        self.n_dates, self.n_bands = n_dates, n_bands
        self.embed = nn.Sequential(nn.Conv2d(n_bands, dim, 1), nn.BatchNorm2d(dim), nn.ReLU(inplace=True))
        self.score = nn.Conv2d(dim, 1, 1)

    def forward(self, x):
        b, _, h, w = x.shape
        x = x.view(b * self.n_dates, self.n_bands, h, w)
        e = self.embed(x).view(b, self.n_dates, -1, h, w)
        a = torch.softmax(self.score(e.flatten(0, 1)).view(b, self.n_dates, 1, h, w), dim=1)
        return (a * e).sum(1)


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CropUNet(nn.Module):
    def __init__(self, n_dates, n_bands, n_classes, dim=64):
        super().__init__()
        self.temporal = TemporalEncoder(n_dates, n_bands, dim)
        self.d1, self.d2, self.d3 = block(dim, 64), block(64, 128), block(128, 256)
        self.u2, self.u1 = nn.ConvTranspose2d(256, 128, 2, 2), nn.ConvTranspose2d(128, 64, 2, 2)
        self.c2, self.c1 = block(256, 128), block(128, 64)
        self.out = nn.Conv2d(64, n_classes, 1)

    def forward(self, x):
        x = self.temporal(x)
        s1 = self.d1(x)
        s2 = self.d2(F.max_pool2d(s1, 2))
        s3 = self.d3(F.max_pool2d(s2, 2))
        x = self.c2(torch.cat([self.u2(s3), s2], 1))
        x = self.c1(torch.cat([self.u1(x), s1], 1))
        return self.out(x)


@torch.no_grad()
def evaluate(model, loader, criterion, n_classes, device):
    model.eval()
    cm = torch.zeros(n_classes, n_classes, dtype=torch.int64, device=device)
    loss_sum, n_batches = 0.0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss_sum += criterion(logits, y).item()
        n_batches += 1
        pred = logits.argmax(1)
        cm += torch.bincount(y.flatten() * n_classes + pred.flatten(),
                             minlength=n_classes ** 2).view(n_classes, n_classes)
    inter = cm.diag().double()
    union = cm.sum(0).double() + cm.sum(1).double() - inter
    iou = (inter / union.clamp(min=1)).cpu()
    return {"loss": loss_sum / max(n_batches, 1), "iou": iou,
            "miou": iou[1:].mean().item(),            # background excluded
            "oa": (inter.sum() / cm.sum().clamp(min=1)).item()}


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    stats = np.load(os.path.join(cfg["data_root"], "band_stats.npz"))
    n_classes = len(cfg["classes"])
    train_ds = CropPatches(cfg["data_root"], "train", stats, augment=True)
    val_ds = CropPatches(cfg["data_root"], "val", stats, augment=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))),
                            batch_size=cfg["batch_size"], num_workers=cfg["workers"], pin_memory=True)

    model = CropUNet(cfg["n_dates"], cfg["n_bands"], n_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = cfg["lr"] * world * cfg["batch_size"] / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg["epochs"] * len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg["label_smoothing"])

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)
        print(f"{len(train_ds)} train / {len(val_ds)} val patches, lr {lr:.2e}", flush=True)

    best_miou = -1.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"  epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model.module, val_loader, criterion, n_classes, device)
        if rank == 0:
            per_class = ", ".join(f"{c}={v:.3f}" for c, v in zip(cfg["classes"], metrics["iou"].tolist()))
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val loss {metrics['loss']:.4f} "
                  f"mIoU {metrics['miou']:.4f} OA {metrics['oa']:.4f}\n    {per_class}", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "metrics": {k: v for k, v in metrics.items() if k != "iou"}}
            torch.save(ckpt, os.path.join(cfg["out_dir"], "last.pt"))
            if metrics["miou"] > best_miou:
                best_miou = metrics["miou"]
                torch.save(ckpt, os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
