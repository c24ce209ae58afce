"""Siamese U-Net for building change detection on large aerial/satellite scene pairs.

Each AOI folder holds co-registered rasters:
    <root>/<aoi>/t1.tif  (C, H, W)   pre-event
    <root>/<aoi>/t2.tif  (C, H, W)   post-event
    <root>/<aoi>/cd.tif  (1, H, W)   0 = no change, 1 = change, 255 = nodata
The geographic train/val split is a fixed list of AOIs in splits.json.

Launch:  torchrun --nproc_per_node=4 02_siamese_unet_tiles.py --config configs/siam_unet.yaml
"""
import argparse
import json
import os
import time

import numpy as np
import rasterio
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from rasterio.windows import Window
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255


def build_patch_index(root, aois, patch, stride, min_valid=0.5):
    """Scan every AOI once and keep windows with enough labelled pixels."""
    index = []
    for aoi in aois:
        with rasterio.open(os.path.join(root, aoi, "cd.tif")) as src:
            lab = src.read(1)
        h, w = lab.shape
        for r in range(0, h - patch + 1, stride):
            for c in range(0, w - patch + 1, stride):
                win = lab[r:r + patch, c:c + patch]
                if (win != IGNORE).mean() >= min_valid:
                    index.append((aoi, r, c))
    return index


def load_or_build_index(cache_path, root, aois, patch, stride, rank):
    if rank == 0 and not os.path.exists(cache_path):
        index = build_patch_index(root, aois, patch, stride)
        tmp = cache_path + f".tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, cache_path)
    dist.barrier()
    with open(cache_path) as f:
        return [tuple(x) for x in json.load(f)]


class ScenePairPatches(Dataset):
    def __init__(self, root, index, patch, mean, std, train):
        self.root, self.index, self.patch, self.train = root, index, patch, train
        self.mean = np.asarray(mean, np.float32)[:, None, None]
        self.std = np.asarray(std, np.float32)[:, None, None]
        self._handles = {}  # opened lazily inside each worker

    def _open(self, aoi, name):
        key = (aoi, name)
        if key not in self._handles:
            self._handles[key] = rasterio.open(os.path.join(self.root, aoi, name))
        return self._handles[key]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        aoi, r, c = self.index[i]
        win = Window(c, r, self.patch, self.patch)
        a = (self._open(aoi, "t1.tif").read(window=win).astype(np.float32) - self.mean) / self.std
        b = (self._open(aoi, "t2.tif").read(window=win).astype(np.float32) - self.mean) / self.std
        y = self._open(aoi, "cd.tif").read(1, window=win).astype(np.int64)
        if self.train:
            if np.random.rand() < 0.5:
                a, b, y = a[..., ::-1], b[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                a, b, y = a[:, ::-1], b[:, ::-1], y[::-1]
        return (torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.from_numpy(y.copy()))


class SiameseUNet(nn.Module):
    def __init__(self, backbone, in_chans, grad_ckpt=True):
        super().__init__()
        self.encoder = timm.create_model(backbone, features_only=True, in_chans=in_chans,
                                         pretrained=False)
        chs = self.encoder.feature_info.channels()
        self.grad_ckpt = grad_ckpt
        self.fuse = nn.ModuleList([nn.Conv2d(2 * ch, ch, 1) for ch in chs])
        self.up = nn.ModuleList()
        for i in range(len(chs) - 1, 0, -1):
            self.up.append(nn.Sequential(
                nn.Conv2d(chs[i] + chs[i - 1], chs[i - 1], 3, padding=1),
                nn.BatchNorm2d(chs[i - 1]), nn.ReLU(inplace=True)))
        self.head = nn.Conv2d(chs[0], 2, 1)

    def encode(self, x):
        if self.grad_ckpt and self.training:
            return checkpoint(self.encoder, x, use_reentrant=False)
        return self.encoder(x)

    def forward(self, t1, t2):
        f1, f2 = self.encode(t1), self.encode(t2)
        feats = [fuse(torch.cat([a, b], 1)) for fuse, a, b in zip(self.fuse, f1, f2)]
        x = feats[-1]
        for blk, skip in zip(self.up, reversed(feats[:-1])):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = blk(torch.cat([x, skip], 1))
        return F.interpolate(self.head(x), size=t1.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # tp, fp, fn
    for a, b, y in loader:
        a, b, y = a.to(device), b.to(device), y.to(device)
        pred = net(a, b).argmax(1)
        m = y != IGNORE
        p, t = pred[m] == 1, y[m] == 1
        stats += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
    dist.all_reduce(stats)
    tp, fp, fn = stats.tolist()
    return {"f1": 2 * tp / max(1.0, 2 * tp + fp + fn), "iou": tp / max(1.0, tp + fp + fn)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    with open(cli.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])

    splits = json.load(open(os.path.join(cfg["root"], "splits.json")))
    if rank == 0:
        os.makedirs(cfg["cache_dir"], exist_ok=True)
        os.makedirs(cfg["out_dir"], exist_ok=True)
    dist.barrier()
    idx = {}
    for split in ("train", "val"):
        stride = cfg["patch"] // 2 if split == "train" else cfg["patch"]
        cache = os.path.join(cfg["cache_dir"], f"{split}_p{cfg['patch']}_s{stride}.json")
        idx[split] = load_or_build_index(cache, cfg["root"], splits[split], cfg["patch"], stride, rank)

    train_ds = ScenePairPatches(cfg["root"], idx["train"], cfg["patch"], cfg["mean"], cfg["std"], True)
    val_ds = ScenePairPatches(cfg["root"], idx["val"], cfg["patch"], cfg["mean"], cfg["std"], False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    train_dl = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), cfg["batch_size"],
                        num_workers=cfg["workers"], pin_memory=True)

    # ConvNeXt encoder (LayerNorm), so checkpointed stages hold no BatchNorm
    model = SiameseUNet(cfg.get("backbone", "convnext_tiny"), len(cfg["mean"]),
                        grad_ckpt=cfg.get("grad_ckpt", True))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # global batch = batch_size * world; lr in the config is for a global batch of 64
    lr = cfg["lr"] * cfg["batch_size"] * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["wd"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=cfg["epochs"],
                                                steps_per_epoch=len(train_dl), pct_start=0.05)
    start_epoch, best = 0, -1.0
    if cli.resume:
        ck = torch.load(cli.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    ddp = DDP(model, device_ids=[local_rank])

    run = None
    if rank == 0:
        run = wandb.init(project="cd-buildings", config={**cfg, "world_size": world, "lr": lr},
                         resume="allow")
    weight = torch.tensor([1.0, cfg["pos_weight"]], device=device)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        ddp.train()
        t0, tot, n = time.time(), torch.zeros((), device=device), 0
        for a, b, y in train_dl:
            a, b, y = a.to(device, non_blocking=True), b.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(a, b)
            loss = F.cross_entropy(logits.float(), y, weight=weight, ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.detach()
            n += 1
        dist.all_reduce(tot)
        train_loss = tot.item() / (n * world)
        val = validate(model, val_dl, device)

        if rank == 0:
            run.log({"train/loss": train_loss, "val/f1": val["f1"], "val/iou": val["iou"],
                     "lr": sched.get_last_lr()[0], "epoch_time": time.time() - t0}, step=epoch)
            ck = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "best": max(best, val["f1"]), "cfg": cfg}
            torch.save(ck, os.path.join(cfg["out_dir"], "last.pt"))
            if val["f1"] > best:
                torch.save(ck, os.path.join(cfg["out_dir"], "best.pt"))
                run.summary["best_f1"] = val["f1"]
            print(f"[{epoch}] loss {train_loss:.4f} f1 {val['f1']:.4f} iou {val['iou']:.4f}", flush=True)
        best = max(best, val["f1"])
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
