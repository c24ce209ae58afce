#!/usr/bin/env python
"""Reverse Distillation (RD4AD) for MVTec AD - distributed trainer.

Frozen WideResNet50 teacher encoder -> trainable one-class bottleneck (OCBE) -> trainable
student decoder. Anomaly map = sum over scales of (1 - cos(teacher, student)).

    torchrun --nproc_per_node=2 05_rd4ad_train.py --category cable --accum-steps 2 --grad-ckpt
"""
import argparse
import contextlib
import os
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build_index(root, category, cache_dir):
    """Scan the category folder once and cache (image, label, mask) triples."""
    cache = Path(cache_dir) / f"{category}_index.pkl"
    if cache.exists():
        with open(cache, "rb") as f:
            return pickle.load(f)
    base = Path(root) / category
    index = {"train": [], "test": []}
    for split in index:
        for img in sorted((base / split).glob("*/*.png")):
            defect = img.parent.name
            mask = None if defect == "good" else str(base / "ground_truth" / defect / f"{img.stem}_mask.png")
            index[split].append((str(img), int(defect != "good"), mask))
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(index, f)
    os.replace(tmp, cache)
    return index


class ImageList(Dataset):
    def __init__(self, items, size=256):
        self.items = items
        self.size = size
        self.tf = T.Compose([T.Resize((size, size)), T.ToTensor(), T.Normalize(MEAN, STD)])
        self.mtf = T.Compose([T.Resize((size, size), T.InterpolationMode.NEAREST), T.ToTensor()])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label, mask = self.items[i]
        x = self.tf(Image.open(path).convert("RGB"))
        m = torch.zeros(1, self.size, self.size) if mask is None else (self.mtf(Image.open(mask)) > 0.5).float()
        return x, m, label


class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        net = models.wide_resnet50_2(weights=models.Wide_ResNet50_2_Weights.IMAGENET1K_V1)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3

    def forward(self, x):
        f1 = self.layer1(self.stem(x))
        f2 = self.layer2(f1)
        f3 = self.layer3(f2)
        return [f1, f2, f3]


# GroupNorm instead of BatchNorm in the trainable part: per-GPU micro-batches are only a few images
def conv_bn(cin, cout, k=3, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.GroupNorm(32, cout), nn.ReLU(inplace=True))


class OCBE(nn.Module):
    def __init__(self):
        super().__init__()
        self.d1 = nn.Sequential(conv_bn(256, 512, s=2), conv_bn(512, 1024, s=2))
        self.d2 = conv_bn(512, 1024, s=2)
        self.fuse = nn.Sequential(conv_bn(3 * 1024, 2048, s=2), conv_bn(2048, 2048, k=1))

    def forward(self, feats):
        f1, f2, f3 = feats
        return self.fuse(torch.cat([self.d1(f1), self.d2(f2), f3], dim=1))


class UpStage(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2, bias=False)
        self.body = nn.Sequential(nn.GroupNorm(32, cout), nn.ReLU(inplace=True), conv_bn(cout, cout), conv_bn(cout, cout))

    def forward(self, x):
        return self.body(self.up(x))


class StudentDecoder(nn.Module):
    def __init__(self, grad_ckpt=False):
        super().__init__()
        self.stage3 = UpStage(2048, 1024)  # 8 -> 16
        self.stage2 = UpStage(1024, 512)   # 16 -> 32
        self.stage1 = UpStage(512, 256)    # 32 -> 64
        self.grad_ckpt = grad_ckpt

    def _run(self, stage, x):
        if self.grad_ckpt and self.training:
            return checkpoint(stage, x, use_reentrant=False)
        return stage(x)

    def forward(self, z):
        d3 = self._run(self.stage3, z)
        d2 = self._run(self.stage2, d3)
        d1 = self._run(self.stage1, d2)
        return [d1, d2, d3]


class RDStudent(nn.Module):
    def __init__(self, grad_ckpt):
        super().__init__()
        self.bottleneck = OCBE()
        self.decoder = StudentDecoder(grad_ckpt)

    def forward(self, t_feats):
        return self.decoder(self.bottleneck(t_feats))


def rd_loss(t_feats, s_feats):
    loss = 0.0
    for t, s in zip(t_feats, s_feats):
        loss = loss + (1 - F.cosine_similarity(t.flatten(1), s.flatten(1), dim=1)).mean()
    return loss


@torch.no_grad()
def evaluate(teacher, student, loader, device, size):
    student.eval()
    ys, img_scores, masks, maps = [], [], [], []
    for x, m, y in loader:
        x = x.to(device)
        t = teacher(x)
        s = student(t)
        amap = sum(F.interpolate(1 - F.cosine_similarity(a, b).unsqueeze(1), size=size, mode="bilinear",
                                 align_corners=True) for a, b in zip(t, s))
        amap = np.stack([gaussian_filter(a, sigma=4) for a in amap.squeeze(1).cpu().numpy()])
        maps.append(amap[:, ::4, ::4].ravel())
        masks.append(m[:, 0, ::4, ::4].numpy().ravel().astype(np.uint8))
        img_scores.append(amap.reshape(len(amap), -1).max(axis=1))
        ys.append(y.numpy())
    student.train()
    return (roc_auc_score(np.concatenate(ys), np.concatenate(img_scores)),
            roc_auc_score(np.concatenate(masks), np.concatenate(maps)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/data/mvtec_ad")
    ap.add_argument("--category", default="cable")
    ap.add_argument("--cache-dir", default="/data/cache/rd4ad")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16, help="images per optimizer step, all GPUs")
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-dir", default="checkpoints/rd4ad")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    assert args.global_batch % (world * args.accum_steps) == 0, "global batch must split evenly"
    micro_batch = args.global_batch // (world * args.accum_steps)

    if rank == 0:
        build_index(args.data_root, args.category, args.cache_dir)
    dist.barrier()
    index = build_index(args.data_root, args.category, args.cache_dir)

    train_ds = ImageList(index["train"], args.size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=micro_batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    teacher = Teacher().to(device).eval()
    teacher.requires_grad_(False)
    student = RDStudent(args.grad_ckpt).to(device)
    student = DDP(student, device_ids=[local_rank])
    # paper setting: Adam(lr=0.005, betas=(0.5, 0.999)) at batch 16; the global batch is kept at 16
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr, betas=(0.5, 0.999))

    start_epoch = 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        student.module.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for i, (x, _, _) in enumerate(loader):
            x = x.to(device, non_blocking=True)
            with torch.no_grad():
                t_feats = teacher(x)
            sync_now = (i + 1) % args.accum_steps == 0
            ctx = contextlib.nullcontext() if sync_now else student.no_sync()
            with ctx:
                loss = rd_loss(t_feats, student(t_feats)) / args.accum_steps
                loss.backward()
            if sync_now:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach() * args.accum_steps, torch.ones((), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch} loss {(total[0] / total[1]).item():.4f}", flush=True)

        if rank == 0 and ((epoch + 1) % 10 == 0 or epoch + 1 == args.epochs):
            test_loader = DataLoader(ImageList(index["test"], args.size), batch_size=16, num_workers=args.workers)
            img_auc, px_auc = evaluate(teacher, student.module, test_loader, device, args.size)
            print(f"[{args.category}] epoch {epoch}: image AUROC {img_auc:.4f} pixel AUROC {px_auc:.4f}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"student": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "world_size": world},
                       os.path.join(args.save_dir, f"{args.category}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
