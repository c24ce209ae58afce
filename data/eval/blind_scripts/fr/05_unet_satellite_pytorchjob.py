# Building-footprint segmentation (U-Net, ResNet-34 encoder) on satellite tiles.
#
# PyTorchJob spec (kubeflow training-operator), 2 replicas with 4 x A10G each:
#   containers:
#   - name: pytorch
#     image: 123456789012.dkr.ecr.us-west-2.amazonaws.com/seg-train:1.8
#     command: ["torchrun", "--nnodes=2", "--nproc_per_node=4",
#               "--node_rank=$(RANK)", "--master_addr=$(MASTER_ADDR)", "--master_port=$(MASTER_PORT)",
#               "train_seg.py", "--tiles", "/mnt/tiles", "--out", "/mnt/runs/unet34"]
#     volumeMounts: /mnt/tiles (s3 csi, ro), /mnt/runs (efs, rw)
import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser("unet training")
    parser.add_argument("--tiles", type=str, required=True)
    parser.add_argument("--out", type=str, required=True)
    parser.add_argument("--encoder", type=str, default="resnet34")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--crop", type=int, default=512)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class TileDataset(Dataset):
    def __init__(self, root, split, crop, train):
        self.root = Path(root)
        with open(self.root / f"{split}.json") as f:
            self.items = json.load(f)
        self.crop = crop
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rec = self.items[i]
        img = np.asarray(Image.open(self.root / rec["image"]).convert("RGB"), dtype=np.float32) / 255.0
        mask = np.asarray(Image.open(self.root / rec["mask"]), dtype=np.int64)
        mask = (mask > 0).astype(np.float32)
        h, w = mask.shape
        if self.train:
            y0 = np.random.randint(0, h - self.crop + 1)
            x0 = np.random.randint(0, w - self.crop + 1)
            img = img[y0:y0 + self.crop, x0:x0 + self.crop]
            mask = mask[y0:y0 + self.crop, x0:x0 + self.crop]
            if np.random.rand() < 0.5:
                img, mask = img[:, ::-1], mask[:, ::-1]
            k = np.random.randint(4)
            img, mask = np.rot90(img, k), np.rot90(mask, k)
        img = (img - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
        img = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))).float()
        mask = torch.from_numpy(np.ascontiguousarray(mask))[None]
        return img, mask


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


def dice_loss(logits, target, eps=1.0):
    prob = torch.sigmoid(logits)
    num = 2 * (prob * target).sum(dim=(2, 3)) + eps
    den = prob.sum(dim=(2, 3)) + target.sum(dim=(2, 3)) + eps
    return 1 - (num / den).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    inter_union = torch.zeros(2, dtype=torch.float64, device=device)
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        pred = (model(img) > 0).float()
        inter_union[0] += (pred * mask).sum()
        inter_union[1] += ((pred + mask) > 0).float().sum()
    dist.all_reduce(inter_union)
    model.train()
    return (inter_union[0] / inter_union[1].clamp(min=1)).item()


def main():
    args = get_parser().parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    is_main = rank == 0

    train_ds = TileDataset(args.tiles, "train", args.crop, train=True)
    val_ds = TileDataset(args.tiles, "val", args.crop, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              worker_init_fn=seed_worker)
    val_idx = list(range(rank, len(val_ds), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=4,
                            num_workers=2, pin_memory=True)

    model = smp.Unet(args.encoder, encoder_weights="imagenet", in_channels=3, classes=1)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    bce = nn.BCEWithLogitsLoss()

    out = Path(args.out)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    start_epoch, best_iou = 0, 0.0
    if (out / "last.pt").exists():
        ck = torch.load(out / "last.pt", map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best_iou = ck["epoch"] + 1, ck["best_iou"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for img, mask in train_loader:
            img = img.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img)
            logits = logits.float()
            loss = bce(logits, mask) + dice_loss(logits, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            agg[0] += loss.detach()
            agg[1] += 1
        scheduler.step()
        dist.all_reduce(agg)
        iou = evaluate(model, val_loader, device)

        if is_main:
            print(f"epoch {epoch:03d} loss {agg[0].item() / agg[1].item():.4f} "
                  f"val IoU {iou:.4f} time {time.time() - t0:.0f}s", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_iou": max(best_iou, iou)}
            torch.save(state, out / "last.tmp")
            os.replace(out / "last.tmp", out / "last.pt")
            if iou > best_iou:
                torch.save(model.module.state_dict(), out / "best.pt")
        best_iou = max(best_iou, iou)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
