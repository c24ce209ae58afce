"""Multi-label potato disease scoring from UAV plot crops (late blight, early blight, PVY mosaic).

A plot can carry several symptoms at once, so the head is sigmoid / BCE and
we report per-label F1 at a 0.5 threshold, accumulated over the whole val set.

    torchrun --nproc_per_node=4 11_potato_blight_multilabel.py
"""
import os
import time
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
import tyro

LABELS = ["late_blight", "early_blight", "pvy_mosaic"]


@dataclass
class Config:
    csv: str = "/data/potato_uav/plots.csv"
    img_root: str = "/data/potato_uav/crops"
    arch: str = "efficientnet_b3"
    img_size: int = 300
    epochs: int = 45
    batch_size: int = 24
    lr: float = 4e-4
    weight_decay: float = 1e-4
    workers: int = 8
    pos_weight: List[float] = field(default_factory=lambda: [2.0, 3.0, 4.0])
    out_dir: str = "runs/potato_ml"
    seed: int = 11


class PlotCropDataset(Dataset):
    def __init__(self, df, root, tf):
        self.files = [os.path.join(root, f) for f in df["file"]]
        self.targets = df[LABELS].values.astype(np.float32)
        self.tf = tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(self.files[i]).convert("RGB")
        return self.tf(img), torch.from_numpy(self.targets[i])


def transforms(size):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = T.Compose([
        T.RandomResizedCrop(size, scale=(0.5, 1.0), ratio=(0.8, 1.25)),
        T.RandomHorizontalFlip(),
        T.RandomVerticalFlip(),
        T.RandomApply([T.RandomRotation(90)], p=0.3),
        T.ColorJitter(brightness=0.3, contrast=0.3, saturation=0.2),
        T.ToTensor(),
        norm,
    ])
    val = T.Compose([T.Resize((size, size)), T.ToTensor(), norm])
    return train, val


def f1_from_counts(tp, fp, fn):
    return 2 * tp / np.maximum(2 * tp + fp + fn, 1)


def run_validation(model, loader, device):
    model.eval()
    tp = np.zeros(len(LABELS))
    fp = np.zeros(len(LABELS))
    fn = np.zeros(len(LABELS))
    with torch.no_grad():
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                prob = torch.sigmoid(model(x).float())
            pred = (prob > 0.5).cpu().numpy()
            y = y.numpy().astype(bool)
            tp += (pred & y).sum(0)
            fp += (pred & ~y).sum(0)
            fn += (~pred & y).sum(0)
    counts = torch.from_numpy(np.stack([tp, fp, fn]))
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    tp, fp, fn = counts.numpy()
    return f1_from_counts(tp, fp, fn)


def main(cfg: Config):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)

    df = pd.read_csv(cfg.csv)
    train_df = df[df["split"] == "train"].reset_index(drop=True)
    val_df = df[df["split"] == "val"].reset_index(drop=True)
    train_tf, val_tf = transforms(cfg.img_size)
    train_ds = PlotCropDataset(train_df, cfg.img_root, train_tf)
    val_ds = PlotCropDataset(val_df, cfg.img_root, val_tf)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    val_subset = torch.utils.data.Subset(val_ds, np.arange(rank, len(val_ds), world).tolist())
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_subset, batch_size=64, num_workers=cfg.workers, pin_memory=True)

    model = timm.create_model(cfg.arch, pretrained=True, num_classes=len(LABELS), drop_rate=0.3)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(cfg.pos_weight, device=device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"train {len(train_ds)}  val {len(val_ds)}  positives/label {train_df[LABELS].sum().tolist()}")

    best = -1.0
    for epoch in range(cfg.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = criterion(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_meter += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(loss_meter)

        f1 = run_validation(model.module, val_loader, device)
        macro = float(f1.mean())
        if rank == 0:
            per = "  ".join(f"{n}={v:.3f}" for n, v in zip(LABELS, f1))
            print(f"epoch {epoch:02d}  loss {(loss_meter[0] / loss_meter[1]).item():.4f}  {per}  "
                  f"macroF1={macro:.4f}  {time.time() - t0:.0f}s", flush=True)
            if macro > best:
                best = macro
                torch.save({"model": model.module.state_dict(), "cfg": cfg.__dict__, "epoch": epoch,
                            "f1": f1.tolist()}, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(Config))
