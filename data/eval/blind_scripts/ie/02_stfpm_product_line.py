"""STFPM student-teacher training for one product line (MVTec-style layout).

    torchrun --nproc_per_node=4 train_stfpm.py --data /mnt/nfs/inspection/mvtec \
        --category screw --out /mnt/nfs/inspection/runs/stfpm
"""
import argparse
import logging
import os
import random
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

log = logging.getLogger("stfpm")

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--category", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="global batch size")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class MVTecDataset(Dataset):
    def __init__(self, root, category, split, size, augment=False):
        base = Path(root) / category / split
        self.size = size
        self.items = []
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            for img in sorted(d.glob("*.png")):
                if d.name == "good":
                    self.items.append((img, None, 0))
                else:
                    mask = Path(root) / category / "ground_truth" / d.name / f"{img.stem}_mask.png"
                    self.items.append((img, mask, 1))
        tf = [transforms.Resize((size, size))]
        if augment:
            tf += [transforms.RandomHorizontalFlip(), transforms.ColorJitter(0.1, 0.1)]
        self.tf = transforms.Compose(tf + [transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        self.mask_tf = transforms.Compose([
            transforms.Resize((size, size), interpolation=transforms.InterpolationMode.NEAREST),
            transforms.ToTensor(),
        ])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img_path, mask_path, label = self.items[i]
        img = self.tf(Image.open(img_path).convert("RGB"))
        if mask_path is None:
            mask = torch.zeros(1, self.size, self.size)
        else:
            mask = (self.mask_tf(Image.open(mask_path)) > 0.5).float()
        return img, mask, label, i


class PyramidNet(nn.Module):
    """ResNet18 truncated after layer3; returns the three pyramid levels."""

    def __init__(self, pretrained):
        super().__init__()
        net = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1 if pretrained else None)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3

    def forward(self, x):
        f1 = self.layer1(self.stem(x))
        f2 = self.layer2(f1)
        f3 = self.layer3(f2)
        return [f1, f2, f3]


def stfpm_loss(t_feats, s_feats):
    loss = 0.0
    for t, s in zip(t_feats, s_feats):
        t, s = F.normalize(t, dim=1), F.normalize(s, dim=1)
        loss = loss + 0.5 * ((t - s) ** 2).sum(dim=1).mean()
    return loss


@torch.no_grad()
def anomaly_map(t_feats, s_feats, size):
    amap = torch.ones(t_feats[0].shape[0], 1, size, size, device=t_feats[0].device)
    for t, s in zip(t_feats, s_feats):
        d = 1 - F.cosine_similarity(t, s, dim=1).unsqueeze(1)
        amap = amap * F.interpolate(d, size=size, mode="bilinear", align_corners=False)
    return amap


@torch.no_grad()
def evaluate(teacher, student, loader, size, device, world_size):
    student.eval()
    results = []
    for img, mask, label, idx in loader:
        img = img.to(device, non_blocking=True)
        amap = anomaly_map(teacher(img), student(img), size)
        for k in range(len(idx)):
            results.append((int(idx[k]), float(amap[k].max()), int(label[k]),
                            amap[k, 0].half().cpu().numpy(), mask[k, 0].bool().numpy()))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    student.train()
    if dist.get_rank() != 0:
        return None
    # DistributedSampler pads the last batch with repeats; keep one entry per index
    by_idx = {}
    for part in gathered:
        for r in part:
            by_idx[r[0]] = r
    rows = [by_idx[i] for i in sorted(by_idx)]
    labels = np.array([r[2] for r in rows])
    scores = np.array([r[1] for r in rows])
    amaps = np.stack([r[3] for r in rows]).astype(np.float32).ravel()
    masks = np.stack([r[4] for r in rows]).ravel()
    return {"image_auroc": roc_auc_score(labels, scores),
            "pixel_auroc": roc_auc_score(masks, amaps),
            "n": len(rows)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [r{rank}] %(message)s")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    out_dir = Path(args.out) / args.category
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    # only rank 0 fetches the ImageNet weights; the others read them from the hub cache
    if rank != 0:
        dist.barrier()
    teacher = PyramidNet(pretrained=True)
    if rank == 0:
        dist.barrier()
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = PyramidNet(pretrained=False)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[local_rank])

    per_gpu_batch = args.batch_size // (world_size * args.accum_steps)
    train_ds = MVTecDataset(args.data, args.category, "train", args.image_size, augment=True)
    test_ds = MVTecDataset(args.data, args.category, "test", args.image_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=16, sampler=test_sampler, num_workers=4, pin_memory=True)

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        student.module.load_state_dict(ckpt["student"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", 0.0)
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    log.info("train %d imgs, test %d imgs, %d GPUs x %d per GPU x %d accum",
             len(train_ds), len(test_ds), world_size, per_gpu_batch, args.accum_steps)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0, running = time.time(), 0.0
        optimizer.zero_grad(set_to_none=True)
        for step, (img, _, _, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            with torch.no_grad():
                t_feats = teacher(img)
            sync_now = (step + 1) % args.accum_steps == 0
            if sync_now:
                loss = stfpm_loss(t_feats, student(img)) / args.accum_steps
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with student.no_sync():
                    loss = stfpm_loss(t_feats, student(img)) / args.accum_steps
                    loss.backward()
            running += loss.item() * args.accum_steps

        stats = torch.tensor([running, len(train_loader)], device=device)
        dist.all_reduce(stats)
        log.info("epoch %d loss %.4f (%.0fs)", epoch, (stats[0] / stats[1]).item(), time.time() - t0)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            metrics = evaluate(teacher, student.module, test_loader, args.image_size, device, world_size)
            if rank == 0:
                log.info("epoch %d image AUROC %.4f pixel AUROC %.4f (n=%d)", epoch,
                         metrics["image_auroc"], metrics["pixel_auroc"], metrics["n"])
                state = {"student": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "best": max(best, metrics["image_auroc"]), "args": vars(args)}
                torch.save(state, out_dir / "last.pt")
                if metrics["image_auroc"] > best:
                    best = metrics["image_auroc"]
                    torch.save(state, out_dir / "best.pt")
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
