#!/usr/bin/env python3
"""STFPM (Student-Teacher Feature Pyramid Matching) on MVTec AD, multi-GPU training.

Teacher: ImageNet-pretrained ResNet-18 (frozen). Student: same architecture, random init.
The student is trained to regress the teacher's layer1..layer3 features on good images only;
at test time the per-layer cosine discrepancy is the anomaly map.
"""
import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

logger = logging.getLogger("stfpm")

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class MVTecDataset(Dataset):
    def __init__(self, root, category, split="train", image_size=256):
        self.split = split
        base = Path(root) / category
        self.samples = []
        for defect_dir in sorted((base / split).iterdir()):
            if not defect_dir.is_dir():
                continue
            label = 0 if defect_dir.name == "good" else 1
            for img_path in sorted(defect_dir.glob("*.png")):
                mask_path = None
                if label == 1:
                    mask_path = base / "ground_truth" / defect_dir.name / f"{img_path.stem}_mask.png"
                self.samples.append((str(img_path), label, mask_path))
        self.transform = transforms.Compose([
            transforms.Resize((image_size, image_size)),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ])
        self.mask_transform = transforms.Compose([
            transforms.Resize((image_size, image_size), interpolation=transforms.InterpolationMode.NEAREST),
            transforms.ToTensor(),
        ])
        self.image_size = image_size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, label, mask_path = self.samples[idx]
        img = self.transform(Image.open(path).convert("RGB"))
        if mask_path is None:
            mask = torch.zeros(1, self.image_size, self.image_size)
        else:
            mask = (self.mask_transform(Image.open(mask_path)) > 0.5).float()
        return img, mask, label


class FeatureExtractor(nn.Module):
    def __init__(self, pretrained):
        super().__init__()
        weights = models.ResNet18_Weights.IMAGENET1K_V1 if pretrained else None
        net = models.resnet18(weights=weights)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1 = net.layer1
        self.layer2 = net.layer2
        self.layer3 = net.layer3

    def forward(self, x):
        x = self.stem(x)
        f1 = self.layer1(x)
        f2 = self.layer2(f1)
        f3 = self.layer3(f2)
        return [f1, f2, f3]


def stfpm_loss(t_feats, s_feats):
    loss = 0.0
    for t, s in zip(t_feats, s_feats):
        t = F.normalize(t, dim=1)
        s = F.normalize(s, dim=1)
        loss = loss + 0.5 * ((t - s) ** 2).sum(dim=1).mean()
    return loss


@torch.no_grad()
def anomaly_map(t_feats, s_feats, out_size):
    amap = None
    for t, s in zip(t_feats, s_feats):
        d = 1 - F.cosine_similarity(t, s, dim=1).unsqueeze(1)
        d = F.interpolate(d, size=out_size, mode="bilinear", align_corners=False)
        amap = d if amap is None else amap * d
    return amap


@torch.no_grad()
def evaluate(teacher, student, loader, device):
    student.eval()
    img_scores, img_labels, pix_scores, pix_labels = [], [], [], []
    for img, mask, label in loader:
        img = img.to(device, non_blocking=True)
        amap = anomaly_map(teacher(img), student(img), img.shape[-2:])
        img_scores.append(amap.flatten(1).max(dim=1).values.cpu())
        img_labels.append(label)
        pix_scores.append(amap[:, :, ::4, ::4].flatten().cpu())
        pix_labels.append(mask[:, :, ::4, ::4].flatten())
    img_scores = torch.cat(img_scores).numpy()
    img_labels = torch.cat(img_labels).numpy()
    pix_scores = torch.cat(pix_scores).numpy()
    pix_labels = torch.cat(pix_labels).numpy().astype(np.uint8)
    student.train()
    return roc_auc_score(img_labels, img_scores), roc_auc_score(pix_labels, pix_scores)


def parse_args():
    p = argparse.ArgumentParser(description="STFPM training")
    p.add_argument("--data_root", type=str, default="/data/mvtec_ad")
    p.add_argument("--category", type=str, default="bottle")
    p.add_argument("--image_size", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16, help="per GPU")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.4, help="for a global batch of 32, scaled linearly")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--output_dir", type=str, default="./runs/stfpm")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    out_dir = Path(args.output_dir) / args.category
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        logger.info("world_size=%d args=%s", world_size, vars(args))

    torch.manual_seed(42)
    train_set = MVTecDataset(args.data_root, args.category, "train", args.image_size)
    test_set = MVTecDataset(args.data_root, args.category, "test", args.image_size)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=args.workers > 0)
    test_loader = DataLoader(test_set, batch_size=32, shuffle=False, num_workers=args.workers,
                             pin_memory=True)

    teacher = FeatureExtractor(pretrained=True).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = FeatureExtractor(pretrained=False).to(device)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    student = DDP(student, device_ids=[device.index], output_device=device.index)

    lr = args.lr * args.batch_size * world_size / 32
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    best_pixel_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for img, _, _ in train_loader:
            img = img.to(device, non_blocking=True)
            with torch.no_grad():
                t_feats = teacher(img)
            s_feats = student(img)
            loss = stfpm_loss(t_feats, s_feats)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running[0] += loss.detach()
            running[1] += 1

        dist.all_reduce(running)
        if rank == 0:
            logger.info("epoch %d loss %.5f (%.1fs)", epoch, (running[0] / running[1]).item(),
                        time.time() - t0)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                img_auc, pix_auc = evaluate(teacher, student.module, test_loader, device)
                logger.info("epoch %d image AUROC %.4f pixel AUROC %.4f", epoch, img_auc, pix_auc)
                ckpt = {"epoch": epoch, "student": student.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "image_auroc": img_auc,
                        "pixel_auroc": pix_auc}
                torch.save(ckpt, out_dir / "last.pth")
                if pix_auc > best_pixel_auc:
                    best_pixel_auc = pix_auc
                    torch.save(ckpt, out_dir / "best.pth")
            dist.barrier()

    if rank == 0:
        logger.info("done, best pixel AUROC %.4f", best_pixel_auc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
