"""Agricultural field boundary delineation (AI4Boundaries-style Sentinel-2 monthly composites).

Inputs: 6 monthly composites x 4 bands (B2, B3, B4, B8) stacked to 24 channels,
256x256 at 10 m. Targets: field extent, boundary and distance transform (ResUNet-a
style multitask). A random 10% of the tiles is held out for validation.

    torchrun --nproc_per_node=4 03_field_boundary_mtl.py --data /data/ai4boundaries/sentinel2
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
import segmentation_models_pytorch as smp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/ai4boundaries/sentinel2")
    p.add_argument("--out", default="runs/fields_unet_mt")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class FieldTiles(Dataset):
    def __init__(self, pairs, augment):
        self.pairs, self.augment = pairs, augment

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        img_path, mask_path = self.pairs[i]
        with xr.open_dataset(img_path) as ds:
            x = np.stack([ds[b].values for b in ("B2", "B3", "B4", "B8")], 1)  # (T=6, 4, H, W)
        x = np.nan_to_num(x.reshape(-1, *x.shape[-2:]).astype(np.float32) / 10000.0)
        m = np.load(mask_path)  # (3, H, W): extent, boundary, distance
        x = (x - 0.12) / 0.09
        if self.augment:
            k = random.randint(0, 3)
            x, m = np.rot90(x, k, (1, 2)), np.rot90(m, k, (1, 2))
            if random.random() < 0.5:
                x, m = x[:, :, ::-1], m[:, :, ::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(m.astype(np.float32).copy())


class MultiTaskUnet(nn.Module):
    def __init__(self, in_ch):
        super().__init__()
        self.net = smp.Unet("resnet34", encoder_weights=None, in_channels=in_ch, classes=3)

    def forward(self, x):
        out = self.net(x)
        return out[:, 0], out[:, 1], out[:, 2].sigmoid()


def tanimoto_loss(logit, target, smooth=1e-5):
    p = logit.sigmoid()
    tpl = (p * target).sum((1, 2))
    sq = (p * p).sum((1, 2)) + (target * target).sum((1, 2))
    return (1 - (tpl + smooth) / (sq - tpl + smooth)).mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_all(args.seed + rank)

    imgs = sorted(glob.glob(os.path.join(args.data, "images", "*", "*_S2_10m_256.nc")))
    pairs = [(p, p.replace("/images/", "/masks/").replace("_S2_10m_256.nc", "_S2label_10m_256.npy")) for p in imgs]
    random.shuffle(pairs)
    n_val = int(len(pairs) * args.val_frac)
    val_pairs, train_pairs = pairs[:n_val], pairs[n_val:]

    train_ds = FieldTiles(train_pairs, augment=True)
    val_ds = FieldTiles(val_pairs[rank::world], augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=32, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(MultiTaskUnet(24)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_pairs)} train / {len(val_pairs)} val tiles on {world} GPUs")
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, m in train_dl:
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            ext, bnd, dst = model(x)
            loss = (tanimoto_loss(ext, m[:, 0]) + tanimoto_loss(bnd, m[:, 1])
                    + F.mse_loss(dst, m[:, 2]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, m in val_dl:
                ext, _, _ = model.module(x.to(device))
                pred, gt = ext.sigmoid() > 0.5, m[:, 0].to(device) > 0.5
                s += torch.stack([(pred & gt).sum(), (pred & ~gt).sum(), (~pred & gt).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        iou = tp / max(tp + fp + fn, 1)

        if rank == 0:
            print(f"epoch {epoch:2d} loss {(run[0] / run[1]).item():.4f} extent IoU {iou:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "iou": iou}, os.path.join(args.out, "last.pt"))
            if iou > best:
                best = iou
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "iou": iou},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
