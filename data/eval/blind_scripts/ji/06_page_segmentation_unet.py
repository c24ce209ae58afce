"""Pixel-level page segmentation (dhSegment style) for historical newspapers.

Classes: background, text region, image, separator, table, decoration.
Full pages are large, so each GPU only holds two 1280x1280 crops per step.

    torchrun --nnodes=1 --nproc_per_node=8 06_page_segmentation_unet.py --cfg configs/newspaper_seg.yaml
"""
import argparse
import glob
import os
import random

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

Image.MAX_IMAGE_PIXELS = None

DEFAULT_CFG = {
    "data_dir": "/data/newseye_seg",
    "encoder": "resnet50",
    "num_classes": 6,
    "crop": 1280,
    "batch_size": 2,
    "epochs": 80,
    "lr": 3e-4,
    "weight_decay": 1e-4,
    "workers": 8,
    "out_dir": "outputs/page_seg",
    "class_weights": [0.5, 1.0, 2.0, 3.0, 2.0, 2.0],
}


def load_cfg(path):
    cfg = dict(DEFAULT_CFG)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


class PageSegDataset(Dataset):
    """Expects <dir>/<split>/images/*.jpg and <dir>/<split>/labels/*.png (palette index = class)."""

    def __init__(self, root, split, crop, train):
        self.images = sorted(glob.glob(os.path.join(root, split, "images", "*.jpg")))
        self.label_dir = os.path.join(root, split, "labels")
        self.crop = crop
        self.train = train

    def __len__(self):
        return len(self.images)

    def _load(self, i):
        path = self.images[i]
        stem = os.path.splitext(os.path.basename(path))[0]
        img = Image.open(path).convert("RGB")
        lab = Image.open(os.path.join(self.label_dir, stem + ".png"))
        # work at half resolution, newspapers are scanned at 400 dpi
        w, h = img.size
        img = img.resize((w // 2, h // 2), Image.BILINEAR)
        lab = lab.resize((w // 2, h // 2), Image.NEAREST)
        return np.asarray(img, dtype=np.float32) / 255.0, np.asarray(lab, dtype=np.int64)

    def __getitem__(self, i):
        img, lab = self._load(i)
        h, w = lab.shape
        c = self.crop
        if self.train:
            pad_h, pad_w = max(0, c - h), max(0, c - w)
            if pad_h or pad_w:
                img = np.pad(img, ((0, pad_h), (0, pad_w), (0, 0)), constant_values=1.0)
                lab = np.pad(lab, ((0, pad_h), (0, pad_w)), constant_values=0)
                h, w = lab.shape
            y = random.randint(0, h - c)
            x = random.randint(0, w - c)
            img, lab = img[y:y + c, x:x + c], lab[y:y + c, x:x + c]
            if random.random() < 0.3:
                img = np.clip(img * random.uniform(0.8, 1.2), 0, 1)
        else:
            # pad to a multiple of 32 for the encoder
            ph, pw = (32 - h % 32) % 32, (32 - w % 32) % 32
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)), constant_values=1.0)
            lab = np.pad(lab, ((0, ph), (0, pw)), constant_values=255)
        img = (img - 0.5) / 0.25
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), torch.from_numpy(np.ascontiguousarray(lab))


def confusion(pred, target, n):
    keep = target != 255
    idx = target[keep] * n + pred[keep]
    return torch.bincount(idx, minlength=n * n).reshape(n, n)


@torch.no_grad()
def evaluate(model, loader, n_cls, device):
    model.eval()
    cm = torch.zeros(n_cls, n_cls, dtype=torch.long, device=device)
    for img, lab in loader:
        img, lab = img.to(device), lab.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(img)
        cm += confusion(logits.argmax(1), lab, n_cls)
    dist.all_reduce(cm)
    model.train()
    iou = cm.diag().float() / (cm.sum(0) + cm.sum(1) - cm.diag()).clamp(min=1).float()
    return iou.mean().item(), iou.tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = load_cfg(cli.cfg)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    seed = 17 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(17)

    train_ds = PageSegDataset(cfg["data_dir"], "train", cfg["crop"], train=True)
    val_ds = PageSegDataset(cfg["data_dir"], "val", cfg["crop"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                              worker_init_fn=lambda wid: np.random.seed(seed * 100 + wid))
    # every rank scores a disjoint slice of the validation pages (no padding duplicates)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=4)

    model = smp.Unet(encoder_name=cfg["encoder"], encoder_weights="imagenet",
                     classes=cfg["num_classes"], decoder_attention_type="scse")
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    weights = torch.tensor(cfg["class_weights"], device=device)
    ce = nn.CrossEntropyLoss(weight=weights, ignore_index=255)
    dice = smp.losses.DiceLoss("multiclass", ignore_index=255)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"],
                                                    total_steps=cfg["epochs"] * len(train_loader),
                                                    pct_start=0.05)

    start = 0
    best = 0.0
    if cli.resume:
        ckpt = torch.load(cli.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optim"])
        scheduler.load_state_dict(ckpt["sched"])
        start, best = ckpt["epoch"] + 1, ckpt["best"]

    os.makedirs(cfg["out_dir"], exist_ok=True)
    for epoch in range(start, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        loss_acc = torch.zeros(2, device=device)
        for img, lab in train_loader:
            img = img.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            logits = logits.float()
            loss = ce(logits, lab) + dice(logits, lab)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        if epoch % 5 == 4 or epoch == cfg["epochs"] - 1:
            miou, per_class = evaluate(model.module, val_loader, cfg["num_classes"], device)
            if rank == 0:
                print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} mIoU {miou:.4f} "
                      f"per-class {[round(x, 3) for x in per_class]}", flush=True)
                state = {"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                         "sched": scheduler.state_dict(), "epoch": epoch, "best": max(best, miou), "cfg": cfg}
                torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
                if miou > best:
                    torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
            best = max(best, miou)
        elif rank == 0:
            print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
