#!/usr/bin/env python
"""Convolutional autoencoder for high-resolution fabric / textile inspection.

Trained on defect-free 512x512 crops from the line-scan camera. At test time
the per-pixel reconstruction error (L2 + SSIM) is the anomaly map; the image
score is the max of the smoothed map.

    torchrun --nproc_per_node=8 02_textile_ae.py --config configs/textile_ae.yaml
"""
import argparse
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from pytorch_msssim import ssim
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

DEFAULTS = {
    "data_root": "/data/inspection/textile_v3",
    "output_dir": "/shared/experiments/textile_ae",
    "image_size": 512,
    "latent_channels": 256,
    "global_batch_size": 32,
    "epochs": 300,
    "lr": 2e-4,
    "weight_decay": 1e-5,
    "ssim_weight": 0.5,
    "workers": 8,
    "eval_every": 10,
    "seed": 1234,
}


class CropFolder(Dataset):
    def __init__(self, root, size, train=True):
        self.paths = sorted(Path(root).rglob("*.png"))
        self.train = train
        aug = [transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip()] if train else []
        self.tf = transforms.Compose(aug + [transforms.Resize((size, size)), transforms.ToTensor()])
        self.mask_tf = transforms.Compose([transforms.Resize((size, size), interpolation=transforms.InterpolationMode.NEAREST),
                                           transforms.ToTensor()])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        p = self.paths[i]
        img = self.tf(Image.open(p).convert("RGB"))
        if self.train:
            return img
        label = 0 if p.parent.name == "good" else 1
        mask_path = p.parent.parent.parent / "ground_truth" / p.parent.name / (p.stem + "_mask.png")
        if label and mask_path.exists():
            mask = self.mask_tf(Image.open(mask_path).convert("L"))
        else:
            mask = torch.zeros(1, img.shape[1], img.shape[2])
        return img, label, mask


def conv_block(cin, cout, down=True):
    conv = nn.Conv2d(cin, cout, 4, 2, 1) if down else nn.ConvTranspose2d(cin, cout, 4, 2, 1)
    return nn.Sequential(conv, nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, inplace=True))


class TextileAE(nn.Module):
    def __init__(self, latent=256):
        super().__init__()
        chans = [3, 32, 64, 128, 256, 256]
        self.encoder = nn.Sequential(*[conv_block(chans[i], chans[i + 1]) for i in range(len(chans) - 1)])
        self.bottleneck = nn.Sequential(nn.Conv2d(256, latent, 1), nn.BatchNorm2d(latent), nn.LeakyReLU(0.2, True))
        dchans = [latent, 256, 128, 64, 32]
        self.decoder = nn.Sequential(*[conv_block(dchans[i], dchans[i + 1], down=False) for i in range(len(dchans) - 1)])
        self.head = nn.Sequential(nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Sigmoid())

    def forward(self, x):
        z = self.bottleneck(self.encoder(x))
        return self.head(self.decoder(z))


def recon_loss(x, y, ssim_weight):
    l2 = F.mse_loss(y, x)
    s = 1.0 - ssim(y, x, data_range=1.0, size_average=True)
    return (1 - ssim_weight) * l2 + ssim_weight * s


def gaussian_blur(maps, sigma=4):
    radius = int(4 * sigma + 0.5)
    xs = torch.arange(-radius, radius + 1, device=maps.device, dtype=maps.dtype)
    k = torch.exp(-xs ** 2 / (2 * sigma ** 2))
    k = k / k.sum()
    maps = F.conv2d(maps, k.view(1, 1, 1, -1), padding=(0, radius))
    return F.conv2d(maps, k.view(1, 1, -1, 1), padding=(radius, 0))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    img_scores, img_labels, px_scores, px_labels = [], [], [], []
    for img, label, mask in loader:
        img = img.to(device)
        rec = model(img)
        amap = ((rec - img) ** 2).mean(dim=1, keepdim=True)
        amap = gaussian_blur(amap)
        img_scores.append(amap.flatten(1).max(dim=1).values.cpu())
        img_labels.append(label)
        # pixel AUROC on a 4x downsampled grid to keep memory bounded
        px_scores.append(F.avg_pool2d(amap, 4).flatten().cpu())
        px_labels.append((F.max_pool2d(mask, 4) > 0.5).flatten())
    model.train()
    img_auroc = roc_auc_score(torch.cat(img_labels).numpy(), torch.cat(img_scores).numpy())
    px_auroc = roc_auc_score(torch.cat(px_labels).numpy(), torch.cat(px_scores).numpy())
    return img_auroc, px_auroc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    out_dir = Path(cfg["output_dir"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "config.yaml", "w") as f:
            yaml.safe_dump(cfg, f)

    per_gpu_batch = cfg["global_batch_size"] // world
    train_set = CropFolder(Path(cfg["data_root"]) / "train" / "good", cfg["image_size"], train=True)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = None
    if rank == 0:
        test_set = CropFolder(Path(cfg["data_root"]) / "test", cfg["image_size"], train=False)
        test_loader = DataLoader(test_set, batch_size=8, shuffle=False, num_workers=4)

    model = TextileAE(cfg["latent_channels"]).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    steps_per_epoch = len(train_loader)
    total_steps = cfg["epochs"] * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    start_epoch, best = 0, 0.0
    if cli.resume:
        ckpt = torch.load(cli.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", 0.0)

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), torch.zeros(2, device=device)
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            y = model(x)
            loss = recon_loss(x, y, cfg["ssim_weight"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch:4d} loss {running[0].item() / running[1].item():.5f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        if rank == 0 and ((epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == cfg["epochs"]):
            img_auroc, px_auroc = evaluate(model.module, test_loader, device)
            print(f"  eval: image AUROC {img_auroc:.4f} pixel AUROC {px_auroc:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "epoch": epoch, "best": best, "config": cfg}
            torch.save(state, out_dir / "last.pt")
            if img_auroc > best:
                best = img_auroc
                state["best"] = best
                torch.save(state, out_dir / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
