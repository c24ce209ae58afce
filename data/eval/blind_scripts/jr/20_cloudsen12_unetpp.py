"""
Cloud and cloud-shadow segmentation on CloudSEN12 (high-quality labels, 509x509 Sentinel-2 L1C, 13 bands).
Classes: 0 clear, 1 thick cloud, 2 thin cloud, 3 cloud shadow.

UNet++ with an EfficientNet-B5 encoder on full 512x512 (padded) scenes; 2 scenes per GPU is
what fits in 24 GB with this encoder, so we train on 8 GPUs:

    torchrun --nproc_per_node=8 20_cloudsen12_unetpp.py --data /data/cloudsen12/high --batch-size 2
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

CLASSES = ["clear", "thick", "thin", "shadow"]
N_CLS = len(CLASSES)
PAD = 512


class CloudSEN12(Dataset):
    def __init__(self, root, split, augment):
        meta = pd.read_csv(os.path.join(root, "metadata.csv"))
        meta = meta[meta["split"] == split]
        self.files = [os.path.join(root, f) for f in meta["npz"]]
        self.augment = augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with np.load(self.files[i]) as z:
            img = z["l1c"].astype(np.float32) / 10000.0  # (13, 509, 509)
            lbl = z["label"].astype(np.int64)  # (509, 509)
        h, w = lbl.shape
        img = np.pad(img, ((0, 0), (0, PAD - h), (0, PAD - w)), mode="reflect")
        lbl = np.pad(lbl, ((0, PAD - h), (0, PAD - w)), mode="constant", constant_values=255)
        if self.augment:
            k = np.random.randint(4)
            img, lbl = np.rot90(img, k, (1, 2)), np.rot90(lbl, k)
            if np.random.rand() < 0.5:
                img, lbl = img[:, :, ::-1], lbl[:, ::-1]
        return torch.from_numpy(img.copy()), torch.from_numpy(lbl.copy())


def dice_loss(logits, target, ignore=255, eps=1.0):
    valid = (target != ignore).unsqueeze(1).float()
    prob = logits.softmax(1) * valid
    onehot = F.one_hot(target.clamp(max=N_CLS - 1), N_CLS).permute(0, 3, 1, 2).float() * valid
    inter = (prob * onehot).sum((0, 2, 3))
    denom = prob.sum((0, 2, 3)) + onehot.sum((0, 2, 3))
    return 1.0 - ((2 * inter + eps) / (denom + eps)).mean()


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/cloudsen12_unetpp_b5")
    p.add_argument("--encoder", default="efficientnet-b5")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = CloudSEN12(args.data, "train", augment=True)
    val_ds = CloudSEN12(args.data, "val", augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=4, num_workers=args.workers,
                        pin_memory=True)

    model = smp.UnetPlusPlus(args.encoder, encoder_weights=None, in_channels=13, classes=N_CLS)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_dl), eta_min=1e-6)
    class_w = torch.tensor([1.0, 1.0, 1.5, 2.0], device=device)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} scenes, val {len(val_ds)}, global batch {args.batch_size * world}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for img, lbl in train_dl:
            img, lbl = img.to(device, non_blocking=True), lbl.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                logits = model(img)
            logits = logits.float()
            loss = F.cross_entropy(logits, lbl, weight=class_w, ignore_index=255) + dice_loss(logits, lbl)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])

        net = model.module
        net.eval()
        cm = torch.zeros(N_CLS, N_CLS, dtype=torch.long, device=device)
        with torch.no_grad():
            for img, lbl in val_dl:
                img, lbl = img.to(device), lbl.to(device)
                with torch.cuda.amp.autocast():
                    pred = net(img).argmax(1)
                keep = lbl != 255
                cm += torch.bincount(lbl[keep] * N_CLS + pred[keep], minlength=N_CLS * N_CLS).view(N_CLS, N_CLS)
        dist.all_reduce(cm)
        dist.all_reduce(loss_sum)
        cmf = cm.double()
        iou = cmf.diag() / (cmf.sum(0) + cmf.sum(1) - cmf.diag()).clamp(min=1)
        miou = iou.mean().item()
        # binary cloud (thick+thin) vs rest, the number most users care about
        cloud = cmf[1:3, 1:3].sum()
        cloud_iou = (cloud / (cmf[1:3, :].sum() + cmf[:, 1:3].sum() - cloud).clamp(min=1)).item()

        if rank == 0:
            print(f"epoch {epoch:02d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} mIoU {miou:.4f} "
                  f"cloud IoU {cloud_iou:.4f} | " + " ".join(f"{c}={v:.3f}" for c, v in zip(CLASSES, iou.tolist()))
                  + f" | {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if miou > best:
                best = miou
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
