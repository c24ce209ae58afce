"""HuBMAP-style glomeruli segmentation: 5-fold U-Net, one torchrun job for all folds.

The process group is created and torn down for every fold so that each fold starts
from a clean NCCL state (long jobs on the shared cluster were hitting stale
communicators after the first fold).

    torchrun --standalone --nproc_per_node=8 02_hubmap_unet_folds.py --cfg configs/unet_b4.yaml
"""
import argparse
import os
import time
from datetime import timedelta

import albumentations as A
import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    tiles_csv="data/tiles.csv",
    tile_dir="data/tiles_512",
    out_dir="runs/unet_b4",
    encoder="efficientnet-b4",
    folds=[0, 1, 2, 3, 4],
    epochs=30,
    batch_size=8,
    lr=5e-4,
    workers=8,
    sync_bn=True,
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--folds", type=int, nargs="*", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as fh:
            cfg.update(yaml.safe_load(fh) or {})
    if a.folds:
        cfg["folds"] = a.folds
    return argparse.Namespace(**cfg)


class TileDataset(Dataset):
    def __init__(self, df, tile_dir, aug=None):
        self.ids = df["tile_id"].tolist()
        self.rows = df.index.to_numpy()
        self.tile_dir = tile_dir
        self.aug = aug

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = np.load(os.path.join(self.tile_dir, f"{self.ids[i]}_img.npy"))
        mask = np.load(os.path.join(self.tile_dir, f"{self.ids[i]}_mask.npy"))
        if self.aug is not None:
            out = self.aug(image=img, mask=mask)
            img, mask = out["image"], out["mask"]
        img = torch.from_numpy(img.transpose(2, 0, 1).astype(np.float32) / 255.0)
        mask = torch.from_numpy(mask.astype(np.float32))[None]
        return img, mask, self.rows[i]


train_aug = A.Compose([
    A.HorizontalFlip(), A.VerticalFlip(), A.RandomRotate90(),
    A.ShiftScaleRotate(shift_limit=0.0625, scale_limit=0.2, rotate_limit=15, p=0.7),
    A.OneOf([A.HueSaturationValue(10, 15, 10), A.CLAHE(clip_limit=2), A.RandomBrightnessContrast()], p=0.5),
])


def dice_parts(logits, mask):
    pred = (logits.sigmoid() > 0.5).float()
    inter = (pred * mask).flatten(1).sum(1)
    denom = pred.flatten(1).sum(1) + mask.flatten(1).sum(1)
    return inter, denom


@torch.no_grad()
def validate(model, loader, device):
    """Per-tile intersection / denominator, with flip TTA. Returns GPU tensors."""
    model.eval()
    rows, inters, denoms = [], [], []
    for img, mask, row in loader:
        img, mask = img.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(img)
            logits = logits + torch.flip(model(torch.flip(img, [3])), [3])
            logits = logits + torch.flip(model(torch.flip(img, [2])), [2])
        i, d = dice_parts(logits.float() / 3, mask)
        inters.append(i)
        denoms.append(d)
        rows.append(row.to(device))
    return torch.cat(rows), torch.cat(inters), torch.cat(denoms)


def all_gather_cat(t, world_size):
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return torch.cat(out)


def train_fold(fold, df, cfg):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1000 + fold)

    tr = df[df.fold != fold]
    va = df[df.fold == fold]
    tr_ds = TileDataset(tr, cfg.tile_dir, train_aug)
    va_ds = TileDataset(va, cfg.tile_dir)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=fold)
    va_sampler = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, cfg.batch_size, sampler=tr_sampler, num_workers=cfg.workers,
                       pin_memory=True, drop_last=True, persistent_workers=True)
    va_dl = DataLoader(va_ds, cfg.batch_size, sampler=va_sampler, num_workers=cfg.workers, pin_memory=True)

    model = smp.Unet(cfg.encoder, encoder_weights="imagenet", classes=1)
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(tr_dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss()
    dice_loss = smp.losses.DiceLoss("binary")

    best = -1.0
    best_path = os.path.join(cfg.out_dir, f"unet_fold{fold}.pt")
    for epoch in range(cfg.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for img, mask, _ in tr_dl:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(img)
                loss = bce(logits, mask) + dice_loss(logits, mask)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        rows, inter, denom = validate(model, va_dl, device)
        rows = all_gather_cat(rows, world_size)
        inter = all_gather_cat(inter, world_size)
        denom = all_gather_cat(denom, world_size)
        # drop the tiles the sampler repeated to even out the shards
        rows_np = rows.cpu().numpy()
        _, keep = np.unique(rows_np, return_index=True)
        keep = torch.from_numpy(keep).to(device)
        inter, denom = inter[keep], denom[keep]
        dice = ((2 * inter.sum() + 1e-6) / (denom.sum() + 1e-6)).item()

        if rank == 0:
            print(f"[fold {fold}] epoch {epoch} loss {loss_sum.item() / len(tr_dl):.4f} "
                  f"dice {dice:.4f} {time.time() - t0:.0f}s", flush=True)
            if dice > best:
                torch.save(model.module.state_dict(), best_path)
        best = max(best, dice)

    # reload the best weights on every rank and store per-tile OOF dice
    dist.barrier()
    state = torch.load(best_path, map_location=device)
    model.module.load_state_dict(state)
    rows, inter, denom = validate(model, va_dl, device)
    rows = all_gather_cat(rows, world_size).cpu().numpy()
    inter = all_gather_cat(inter, world_size).cpu().numpy()
    denom = all_gather_cat(denom, world_size).cpu().numpy()
    if rank == 0:
        oof = pd.DataFrame({"row": rows, "inter": inter, "denom": denom}).drop_duplicates("row")
        oof.to_csv(os.path.join(cfg.out_dir, f"oof_fold{fold}.csv"), index=False)

    del model, opt
    torch.cuda.empty_cache()
    dist.destroy_process_group()
    return best


def main():
    cfg = load_cfg()
    os.makedirs(cfg.out_dir, exist_ok=True)
    df = pd.read_csv(cfg.tiles_csv)  # fold column is precomputed (group k-fold by patient)
    results = {}
    for fold in cfg.folds:
        results[fold] = train_fold(fold, df, cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print("best dice per fold:", results, "mean", np.mean(list(results.values())))


if __name__ == "__main__":
    main()
