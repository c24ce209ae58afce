"""
Land-cover segmentation of Sentinel-2 10-band chips with SegFormer (mit-b2 from scratch,
10 input channels). Labels: 9 classes, 255 = no data.

Launch:
    torchrun --standalone --nproc_per_node=8 03_landcover_segformer.py --config configs/lc_segformer_b2.yaml
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import SegformerConfig, SegformerForSemanticSegmentation

CLASSES = ["water", "trees", "grass", "flooded_veg", "crops", "shrub", "built", "bare", "snow"]
IGNORE = 255

DEFAULTS = {
    "data_root": "/datasets/lc_s2_chips",
    "out_dir": "outputs/lc_segformer_b2",
    "bands": ["B02", "B03", "B04", "B05", "B06", "B07", "B08", "B8A", "B11", "B12"],
    "epochs": 60,
    "batch_size": 16,
    "lr": 6e-5,
    "weight_decay": 0.01,
    "num_workers": 8,
    "eval_every": 2,
    "amp": True,
}

log = logging.getLogger("lc")


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


class ChipDataset(Dataset):
    """<root>/<split>/img/*.tif (10 bands, uint16 reflectance), <root>/<split>/lbl/*.tif (uint8)."""

    def __init__(self, root, split, train):
        self.imgs = sorted(glob.glob(os.path.join(root, split, "img", "*.tif")))
        self.lbls = [p.replace(f"{os.sep}img{os.sep}", f"{os.sep}lbl{os.sep}") for p in self.imgs]
        self.train = train
        stats = np.load(os.path.join(root, "band_stats.npz"))
        self.mean = stats["mean"].astype(np.float32)[:, None, None]
        self.std = stats["std"].astype(np.float32)[:, None, None]

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        with rasterio.open(self.imgs[i]) as src:
            img = src.read().astype(np.float32)
        with rasterio.open(self.lbls[i]) as src:
            lbl = src.read(1).astype(np.int64)
        img = (img - self.mean) / self.std
        img[~np.isfinite(img)] = 0.0
        if self.train:
            if np.random.rand() < 0.5:
                img, lbl = img[:, :, ::-1], lbl[:, ::-1]
            if np.random.rand() < 0.5:
                img, lbl = img[:, ::-1, :], lbl[::-1, :]
            k = np.random.randint(4)
            img, lbl = np.rot90(img, k, axes=(1, 2)), np.rot90(lbl, k)
        return torch.from_numpy(np.ascontiguousarray(img)), torch.from_numpy(np.ascontiguousarray(lbl))


def build_model(num_channels, num_classes):
    config = SegformerConfig(
        num_channels=num_channels,
        num_labels=num_classes,
        depths=[3, 4, 6, 3],
        hidden_sizes=[64, 128, 320, 512],
        decoder_hidden_size=768,
        semantic_loss_ignore_index=IGNORE,
    )
    return SegformerForSemanticSegmentation(config)


def forward_logits(model, img):
    out = model(pixel_values=img).logits
    return F.interpolate(out, size=img.shape[-2:], mode="bilinear", align_corners=False)


@torch.no_grad()
def validate(model, loader, device, num_classes):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, lbl in loader:
        img = img.to(device, non_blocking=True)
        lbl = lbl.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = forward_logits(model, img).argmax(1)
        valid = lbl != IGNORE
        hist += torch.bincount(
            lbl[valid] * num_classes + pred[valid], minlength=num_classes ** 2
        ).view(num_classes, num_classes)
    hist = hist.double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag()).clamp(min=1)
    acc = hist.diag().sum() / hist.sum().clamp(min=1)
    model.train()
    return iou.cpu().numpy(), acc.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    cfg = load_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    train_ds = ChipDataset(cfg["data_root"], "train", train=True)
    val_ds = ChipDataset(cfg["data_root"], "val", train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler,
                            num_workers=cfg["num_workers"], pin_memory=True)

    num_classes = len(CLASSES)
    model = build_model(len(cfg["bands"]), num_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total_steps = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=total_steps, power=1.0)

    start_epoch, best_miou = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_miou"]

    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for step, (img, lbl) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            lbl = lbl.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg["amp"]):
                logits = forward_logits(model, img)
                loss = F.cross_entropy(logits.float(), lbl, ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 50 == 0:
                log.info("ep %d it %d/%d loss %.4f lr %.2e", epoch, step, len(train_loader),
                         loss.item(), scheduler.get_last_lr()[0])

        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == cfg["epochs"]:
            iou, acc = validate(model, val_loader, device, num_classes)
            miou = float(np.mean(iou))
            if rank == 0:
                per_class = " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, iou))
                log.info("ep %d val mIoU %.4f OA %.4f | %s | %.0fs", epoch, miou, acc, per_class, time.time() - tic)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "epoch": epoch, "best_miou": max(best_miou, miou)}
                torch.save(state, os.path.join(cfg["out_dir"], "last.pth"))
                if miou > best_miou:
                    torch.save(state, os.path.join(cfg["out_dir"], "best.pth"))
            best_miou = max(best_miou, miou)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
