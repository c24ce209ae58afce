"""Debris-covered glacier outline segmentation (Landsat-8 + SRTM slope/elevation).

Input stack per 256x256 tile: 7 OLI SR bands, NDSI, elevation, slope (10 ch);
labels: 0 background, 1 clean ice, 2 debris-covered ice, 255 nodata.
Tiles are listed per region; HKH region tiles are held out for validation.

    python 17_glacier_segmentation_spawn.py --cfg configs/glacier_hkh.yaml
"""
import argparse
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

DEFAULT_CFG = {
    "tile_root": "/mnt/nas/glaciers/tiles",
    "out_dir": "/mnt/nas/glaciers/runs/unet_r34",
    "val_regions": ["hkh_east", "hkh_west"],
    "classes": ["background", "clean_ice", "debris_ice"],
    "epochs": 80,
    "batch_size": 16,
    "lr": 3e-4,
    "weight_decay": 1e-4,
    "num_workers": 6,
    "master_port": 29512,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    a = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f))
    cfg["gpus"] = a.gpus
    return cfg


class GlacierTiles(Dataset):
    def __init__(self, root, regions, stats, augment):
        self.files = []
        for r in sorted(regions):
            d = os.path.join(root, r, "img")
            self.files += [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".tif")]
        self.mean = np.asarray(stats["mean"], np.float32)[:, None, None]
        self.std = np.asarray(stats["std"], np.float32)[:, None, None]
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        with rasterio.open(path) as src:
            x = src.read().astype(np.float32)
        with rasterio.open(path.replace(os.sep + "img" + os.sep, os.sep + "mask" + os.sep)) as src:
            y = src.read(1).astype(np.int64)
        x = np.nan_to_num((x - self.mean) / self.std)
        if self.augment:
            # slope/aspect are orientation-dependent only through aspect, which we do not use
            k = np.random.randint(4)
            x, y = np.rot90(x, k, (1, 2)), np.rot90(y, k)
            if np.random.rand() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())


def all_regions(root):
    return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


def iou_scores(cm):
    cm = cm.double()
    inter = cm.diag()
    return inter / (cm.sum(0) + cm.sum(1) - inter).clamp(min=1)


def run(rank, cfg, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg['master_port']}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    stats = yaml.safe_load(open(os.path.join(cfg["tile_root"], "band_stats.yaml")))
    regions = all_regions(cfg["tile_root"])
    train_regions = [r for r in regions if r not in cfg["val_regions"]]
    train_ds = GlacierTiles(cfg["tile_root"], train_regions, stats, augment=True)
    val_ds = GlacierTiles(cfg["tile_root"], cfg["val_regions"], stats, augment=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                          num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                        batch_size=cfg["batch_size"], num_workers=cfg["num_workers"])

    n_cls = len(cfg["classes"])
    net = smp.Unet("resnet34", encoder_weights=None, in_channels=10, classes=n_cls)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"] * world_size, weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(cfg["epochs"] * 0.6),
                                                                  int(cfg["epochs"] * 0.85)], gamma=0.1)
    focal = smp.losses.FocalLoss("multiclass", ignore_index=255)
    dice = smp.losses.DiceLoss("multiclass", ignore_index=255)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"train tiles {len(train_ds)} ({len(train_regions)} regions), val tiles {len(val_ds)}", flush=True)

    best_debris = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = focal(logits, y) + dice(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        sched.step()

        net.eval()
        cm = torch.zeros(n_cls, n_cls, dtype=torch.long, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                pred = net(x).argmax(1)
                valid = y != 255
                cm += torch.bincount(y[valid] * n_cls + pred[valid], minlength=n_cls ** 2).view(n_cls, n_cls)
        dist.all_reduce(cm)
        iou = iou_scores(cm)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - tic:.0f}s) IoU "
                  + ", ".join(f"{c}={v:.4f}" for c, v in zip(cfg["classes"], iou.tolist())), flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(cfg["out_dir"], "last.pt"))
            if iou[2] > best_debris:
                best_debris = iou[2].item()
                torch.save(net.state_dict(), os.path.join(cfg["out_dir"], "best_debris_iou.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = load_cfg()
    world_size = cfg["gpus"]
    mp.spawn(run, args=(world_size, cfg), nprocs=world_size, join=True)
