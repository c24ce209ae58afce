"""Building change detection on very-high-resolution RGB pairs, city hold-out.

Layout (one folder per city, 1024x1024 tiles, 0.5 m GSD):
    <root>/<city>/A/<tile>.png      before
    <root>/<city>/B/<tile>.png      after
    <root>/<city>/label/<tile>.png  0 / 255
Whole cities are held out for validation so that neighbouring tiles never
leak between train and val.

    torchrun --standalone --nproc_per_node=8 03_city_holdout_building_cd.py --root /data/bcd
"""
import argparse
import json
import os
import random
from dataclasses import asdict, dataclass

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MEAN = np.array([0.485, 0.456, 0.406] * 2, np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225] * 2, np.float32)[:, None, None]


@dataclass
class Config:
    root: str = "/data/bcd"
    out_dir: str = "runs/bcd_unetpp"
    encoder: str = "efficientnet-b4"
    encoder_ckpt: str = "/data/weights/efficientnet-b4-imagenet.pth"
    crop: int = 512
    val_frac: float = 0.2
    epochs: int = 100
    batch_size: int = 8          # per GPU
    base_lr: float = 2e-4        # per 64 images
    weight_decay: float = 1e-2
    workers: int = 6
    seed: int = 42


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def geographic_split(root, val_frac):
    cities = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    random.shuffle(cities)
    n_val = max(1, int(round(len(cities) * val_frac)))
    return cities[n_val:], cities[:n_val]


class CityPairs(Dataset):
    def __init__(self, root, cities, crop=None, train=False):
        self.items = []
        for city in cities:
            for name in sorted(os.listdir(os.path.join(root, city, "label"))):
                self.items.append(tuple(os.path.join(root, city, sub, name) for sub in ("A", "B", "label")))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        pa, pb, pl = self.items[i]
        a = np.asarray(Image.open(pa).convert("RGB"), np.float32) / 255.0
        b = np.asarray(Image.open(pb).convert("RGB"), np.float32) / 255.0
        y = (np.asarray(Image.open(pl)) > 127).astype(np.float32)
        x = np.concatenate([a, b], axis=2).transpose(2, 0, 1)
        x = (x - MEAN) / STD
        if self.train:
            h, w = y.shape
            r, c = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            x, y = x[:, r:r + self.crop, c:c + self.crop], y[r:r + self.crop, c:c + self.crop]
            if random.random() < 0.5:
                x, y = x[..., ::-1], y[..., ::-1]
            if random.random() < 0.5:
                x, y = x[:, ::-1], y[::-1]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))[None]


def dice_bce(logits, target):
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    inter = (p * target).sum((1, 2, 3))
    dice = 1 - (2 * inter + 1) / (p.sum((1, 2, 3)) + target.sum((1, 2, 3)) + 1)
    return bce + dice.mean()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    tp = fp = fn = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = torch.sigmoid(net(x)) > 0.5
        t = y > 0.5
        tp = tp + (p & t).sum()
        fp = fp + (p & ~t).sum()
        fn = fn + (~p & t).sum()
    s = torch.stack([tp, fp, fn])
    dist.all_reduce(s)
    tp, fp, fn = s.tolist()
    return {"f1": 2 * tp / max(1.0, 2 * tp + fp + fn), "iou": tp / max(1.0, tp + fp + fn)}


def main():
    cfg = Config()
    ap = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    cfg = Config(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream per rank
    seed_everything(cfg.seed + rank)

    train_cities, val_cities = geographic_split(cfg.root, cfg.val_frac)
    train_ds = CityPairs(cfg.root, train_cities, crop=cfg.crop, train=True)
    val_ds = CityPairs(cfg.root, val_cities)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                              num_workers=cfg.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=2,
                            num_workers=cfg.workers, pin_memory=True)

    net = smp.UnetPlusPlus(cfg.encoder, encoder_weights=None, in_channels=6, classes=1)
    if cfg.encoder_ckpt:
        # 3-band ImageNet stem duplicated for the second date
        sd = torch.load(cfg.encoder_ckpt, map_location="cpu")
        stem = [k for k, v in sd.items() if v.ndim == 4 and v.shape[1] == 3][0]
        sd[stem] = torch.cat([sd[stem], sd[stem]], 1) / 2
        net.encoder.load_state_dict(sd)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    lr = cfg.base_lr * cfg.batch_size * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(cfg.out_dir)
        with open(os.path.join(cfg.out_dir, "split.json"), "w") as f:
            json.dump({"train": train_cities, "val": val_cities, "config": asdict(cfg)}, f, indent=2)
        print(f"{len(train_cities)} train cities ({len(train_ds)} tiles), "
              f"{len(val_cities)} val cities ({len(val_ds)} tiles), lr={lr:.2e}")

    best_f1, step = 0.0, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = dice_bce(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if writer is not None and step % 25 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        if (epoch + 1) % 2 == 0 or epoch == cfg.epochs - 1:
            m = evaluate(net, val_loader, device)
            if rank == 0:
                writer.add_scalar("val/f1", m["f1"], epoch)
                writer.add_scalar("val/iou", m["iou"], epoch)
                print(f"epoch {epoch}: val f1 {m['f1']:.4f} iou {m['iou']:.4f}", flush=True)
                if m["f1"] > best_f1:
                    best_f1 = m["f1"]
                    torch.save({"model": net.state_dict(), "epoch": epoch, "f1": best_f1},
                               os.path.join(cfg.out_dir, "best.pt"))
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(cfg.out_dir, "last.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
