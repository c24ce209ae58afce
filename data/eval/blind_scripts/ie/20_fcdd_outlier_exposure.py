"""FCDD (fully convolutional data description) with outlier exposure for the
stamped-bracket line. The few real defect images we have are used as labelled
outliers together with synthetic "confetti" noise; nominal images are the
inliers. Long runs on the shared cluster get pre-empted, hence --resume.

    torchrun --nproc_per_node=4 fcdd_train.py --root /lustre/aoi/brackets --out /lustre/aoi/runs/fcdd \
        --resume /lustre/aoi/runs/fcdd/ckpt_latest.pt
"""
import argparse
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
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--oe-repeat", type=int, default=20, help="repeat the real defects in the OE set")
    p.add_argument("--confetti-prob", type=float, default=0.5)
    p.add_argument("--ckpt-every", type=int, default=5)
    return p.parse_args()


def confetti(img, n_blobs=(3, 12), size=(4, 20)):
    """Paste random colour rectangles onto a tensor image (C,H,W in [0,1])."""
    out = img.clone()
    _, h, w = img.shape
    for _ in range(random.randint(*n_blobs)):
        bh, bw = random.randint(*size), random.randint(*size)
        y, x = random.randint(0, h - bh), random.randint(0, w - bw)
        out[:, y:y + bh, x:x + bw] = torch.rand(3, 1, 1)
    return out


class BracketSet(Dataset):
    def __init__(self, files, labels, size, train, confetti_prob=0.0):
        self.files, self.labels, self.train, self.confetti_prob = files, labels, train, confetti_prob
        aug = [transforms.RandomHorizontalFlip(), transforms.RandomRotation(8)] if train else []
        self.pre = transforms.Compose([transforms.Resize((size, size))] + aug + [transforms.ToTensor()])
        self.norm = transforms.Normalize(MEAN, STD)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = self.pre(Image.open(self.files[i]).convert("RGB"))
        y = self.labels[i]
        if self.train and y == 0 and random.random() < self.confetti_prob:
            x, y = confetti(x), 1
        return self.norm(x), y


class FCDDNet(nn.Module):
    """VGG11-BN features up to conv4 (stride 8) + 1x1 conv to a single channel."""

    def __init__(self):
        super().__init__()
        vgg = models.vgg11_bn(weights=models.VGG11_BN_Weights.IMAGENET1K_V1)
        self.features = nn.Sequential(*list(vgg.features.children())[:15])
        self.head = nn.Sequential(nn.Conv2d(256, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(inplace=True),
                                  nn.Conv2d(128, 1, 1))

    def forward(self, x):
        return self.head(self.features(x))


def fcdd_loss(out, y):
    a = torch.sqrt(out ** 2 + 1) - 1                      # pseudo-Huber anomaly map
    score = a.flatten(1).mean(1)
    anomalous = -torch.log(-torch.expm1(-score) + 1e-9)   # -log(1 - exp(-score))
    y = y.float()
    return ((1 - y) * score + y * anomalous).mean()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    ys, ss = [], []
    for x, y in loader:
        out = net(x.to(device))
        a = torch.sqrt(out ** 2 + 1) - 1
        a = F.interpolate(a, size=x.shape[-1], mode="bilinear", align_corners=False)
        ss += a.flatten(1).amax(1).cpu().tolist()
        ys += y.tolist()
    net.train()
    return roc_auc_score(ys, ss)


def list_images(d):
    return sorted(p for p in Path(d).glob("*") if p.suffix.lower() in (".png", ".jpg", ".bmp"))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    root = Path(args.root)
    nominal = list_images(root / "train" / "good")
    real_defects = [f for d in sorted((root / "train_defects").iterdir()) if d.is_dir() for f in list_images(d)]
    train_ds = ConcatDataset([
        BracketSet(nominal, [0] * len(nominal), args.size, True, args.confetti_prob),
        BracketSet(real_defects * args.oe_repeat, [1] * (len(real_defects) * args.oe_repeat), args.size, True),
    ])
    test_files, test_labels = [], []
    for d in sorted((root / "test").iterdir()):
        fs = list_images(d)
        test_files += fs
        test_labels += [int(d.name != "good")] * len(fs)
    test_ds = BracketSet(test_files, test_labels, args.size, False)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=32, num_workers=4)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(FCDDNet()).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[int(args.epochs * 0.6),
                                                                           int(args.epochs * 0.85)], gamma=0.1)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume} (epoch {ckpt['epoch']}, best AUROC {best:.4f})")
        del ckpt

    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{len(nominal)} nominal, {len(real_defects)} real defects (x{args.oe_repeat}), "
              f"{len(test_ds)} test images, {world} GPUs")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = fcdd_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(acc)

        if rank == 0:
            msg = f"epoch {epoch} loss {(acc[0] / acc[1]).item():.4f} ({time.time() - t0:.0f}s)"
            if (epoch + 1) % args.ckpt_every == 0 or epoch + 1 == args.epochs:
                auroc = evaluate(model.module, test_loader, device)
                msg += f" test AUROC {auroc:.4f}"
                if auroc > best:
                    best = auroc
                    torch.save(model.module.state_dict(), out / "fcdd_best.pt")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best},
                           out / "ckpt_latest.pt")
            print(msg, flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
