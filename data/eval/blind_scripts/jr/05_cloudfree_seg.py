"""Crop-type segmentation on single-date Sentinel-2 L2A patches (DeepLabV3+).

Cloudy / shadowed pixels (from the SCL layer) are excluded from the loss. Patches come
from an HDF5 file produced by our export pipeline:

    /img   (N, 10, 128, 128) uint16
    /scl   (N, 128, 128)     uint8   (Sen2Cor scene classification)
    /label (N, 128, 128)     uint8   (0 = background, 1..19 crop classes, 255 = unknown)

Run:
    torchrun --nproc_per_node=8 05_cloudfree_seg.py --h5 /mnt/fsx/croptype/patches_2022.h5 --run-name dlv3p_r50
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import segmentation_models_pytorch as smp
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

NUM_CLASSES = 20
IGNORE_INDEX = 255
# SCL classes: 3 cloud shadow, 8/9 cloud medium/high prob., 10 thin cirrus, 0/1 no data / saturated
SCL_INVALID = (0, 1, 3, 8, 9, 10)


class H5Patches(Dataset):
    def __init__(self, path, indices=None, augment=False):
        self.path = path
        self.augment = augment
        with h5py.File(path, "r") as f:
            n = f["img"].shape[0]
        self.indices = np.arange(n) if indices is None else np.asarray(indices)
        self._f = None

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        if self._f is None:
            self._f = h5py.File(self.path, "r")
        j = int(self.indices[i])
        img = self._f["img"][j].astype(np.float32) / 10000.0
        scl = self._f["scl"][j]
        label = self._f["label"][j].astype(np.int64)
        label[np.isin(scl, SCL_INVALID)] = IGNORE_INDEX
        if self.augment:
            if np.random.rand() < 0.5:
                img, label = img[:, :, ::-1], label[:, ::-1]
            k = np.random.randint(4)
            img, label = np.rot90(img, k, (1, 2)), np.rot90(label, k)
        return torch.from_numpy(img.copy()), torch.from_numpy(label.copy())


def cosine_lr(step, total, base_lr, warmup):
    if step < warmup:
        return base_lr * (step + 1) / warmup
    return 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0
        self.run_dir = os.path.join(args.out_root, args.run_name)
        if self.is_main:
            os.makedirs(self.run_dir, exist_ok=True)

        with h5py.File(args.h5, "r") as f:
            split = f["split"][:]  # 0 train, 1 val (assigned per parcel cluster at export time)
        full_train = H5Patches(args.h5, np.where(split == 0)[0], augment=True)
        full_val = H5Patches(args.h5, np.where(split == 1)[0], augment=False)
        self.train_sampler = DistributedSampler(full_train, shuffle=True, seed=args.seed, drop_last=True)
        self.train_loader = DataLoader(full_train, batch_size=args.batch_size, sampler=self.train_sampler,
                                       num_workers=args.workers, pin_memory=True, drop_last=True,
                                       persistent_workers=True)
        val_shard = Subset(full_val, range(self.rank, len(full_val), self.world))
        self.val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=args.workers)

        model = smp.DeepLabV3Plus("resnet50", encoder_weights=None, in_channels=10, classes=NUM_CLASSES)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = DDP(model.to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4,
                                   nesterov=True)
        self.total_steps = args.epochs * len(self.train_loader)
        self.step = 0

    def train_epoch(self, epoch):
        args = self.args
        self.model.train()
        self.train_sampler.set_epoch(epoch)
        loss_sum = torch.zeros(1, device=self.device)
        n_used = torch.zeros(1, device=self.device)
        for img, label in self.train_loader:
            img = img.to(self.device, non_blocking=True)
            label = label.to(self.device, non_blocking=True)
            valid_frac = (label != IGNORE_INDEX).float().mean()
            if valid_frac < args.min_valid_frac:
                # almost entirely cloud covered, nothing to learn from this batch
                continue
            for g in self.opt.param_groups:
                g["lr"] = cosine_lr(self.step, self.total_steps, args.lr, args.warmup_steps)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(img)
            loss = F.cross_entropy(logits.float(), label, ignore_index=IGNORE_INDEX)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            loss_sum += loss.detach()
            n_used += 1
        dist.all_reduce(loss_sum)
        dist.all_reduce(n_used)
        return (loss_sum / n_used.clamp(min=1)).item()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        cm = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64, device=self.device)
        for img, label in self.val_loader:
            img = img.to(self.device)
            label = label.to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = self.model.module(img).argmax(1)
            keep = label != IGNORE_INDEX
            cm += torch.bincount(label[keep] * NUM_CLASSES + pred[keep],
                                 minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
        dist.all_reduce(cm)
        cm = cm.double()
        iou = cm.diag() / (cm.sum(0) + cm.sum(1) - cm.diag())
        present = cm.sum(1) > 0
        return iou[present].mean().item(), (cm.diag().sum() / cm.sum()).item()

    def save(self, epoch, miou, name):
        if not self.is_main:
            return
        torch.save({"epoch": epoch, "miou": miou, "model": self.model.module.state_dict(),
                    "opt": self.opt.state_dict(), "step": self.step}, os.path.join(self.run_dir, name))

    def fit(self):
        best = 0.0
        for epoch in range(self.args.epochs):
            t0 = time.time()
            train_loss = self.train_epoch(epoch)
            miou, oa = self.validate()
            if self.is_main:
                print(f"epoch {epoch:3d} | loss {train_loss:.4f} | mIoU {miou:.4f} | OA {oa:.4f} | "
                      f"{time.time() - t0:.0f}s", flush=True)
            self.save(epoch, miou, "last.pt")
            if miou > best:
                best = miou
                self.save(epoch, miou, "best.pt")
        dist.barrier()
        dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--h5", required=True)
    p.add_argument("--out-root", default="/mnt/fsx/croptype/runs")
    p.add_argument("--run-name", default="dlv3p")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=500)
    p.add_argument("--min-valid-frac", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    Trainer(parse_args()).fit()
