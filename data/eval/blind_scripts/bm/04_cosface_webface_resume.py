"""CosFace (large margin cosine loss) on CASIA-WebFace / MS1M-folder layouts.

    torchrun --nproc_per_node=8 04_cosface_webface_resume.py --data /data/faces_webface_112x112_folders
"""
import argparse
import math
import os
import pickle
import time
from datetime import datetime

import io
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def build_parser():
    parser = argparse.ArgumentParser("cosface")
    parser.add_argument("--data", required=True, help="ImageFolder root, one folder per identity")
    parser.add_argument("--val-bins", nargs="*", default=["/data/eval/lfw.bin", "/data/eval/cfp_fp.bin"])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--emb-dim", type=int, default=512)
    parser.add_argument("--scale", type=float, default=64.0)
    parser.add_argument("--margin", type=float, default=0.35)
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=34)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--ckpt-dir", default="checkpoints/cosface")
    parser.add_argument("--resume", default="", help="path to a checkpoint_XX.pth to continue from")
    parser.add_argument("--amp", action="store_true")
    return parser


class FaceResNet(nn.Module):
    """torchvision ResNet adapted to 112x112 crops with an FC-BN embedding layer."""

    def __init__(self, arch="resnet50", emb_dim=512):
        super().__init__()
        net = getattr(torchvision.models, arch)(weights=None)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.body = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2,
                                  net.layer3, net.layer4)
        out_ch = net.fc.in_features
        self.output_layer = nn.Sequential(
            nn.BatchNorm2d(out_ch), nn.Dropout(0.4), nn.Flatten(),
            nn.Linear(out_ch * 7 * 7, emb_dim), nn.BatchNorm1d(emb_dim))

    def forward(self, x):
        return self.output_layer(self.body(x))


class CosFaceHead(nn.Module):
    def __init__(self, emb_dim, num_classes, s=64.0, m=0.35):
        super().__init__()
        self.s, self.m = s, m
        self.kernel = nn.Parameter(torch.empty(num_classes, emb_dim))
        nn.init.xavier_uniform_(self.kernel)

    def forward(self, emb, label):
        cos = F.linear(F.normalize(emb.float()), F.normalize(self.kernel))
        margin = torch.zeros_like(cos).scatter_(1, label.unsqueeze(1), self.m)
        return self.s * (cos - margin)


class CosFaceNet(nn.Module):
    def __init__(self, arch, emb_dim, num_classes, s, m):
        super().__init__()
        self.backbone = FaceResNet(arch, emb_dim)
        self.head = CosFaceHead(emb_dim, num_classes, s, m)

    def forward(self, x, y):
        return self.head(self.backbone(x), y)


def load_bin(path):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    imgs = torch.stack([tf(Image.open(io.BytesIO(b)).convert("RGB")) for b in bins])
    return imgs, np.asarray(issame)


@torch.no_grad()
def eval_verification(backbone, imgs, issame, device):
    backbone.eval()
    feats = []
    for chunk in torch.split(imgs, 512):
        chunk = chunk.to(device)
        feats.append(F.normalize(backbone(chunk) + backbone(chunk.flip(3))).cpu())
    backbone.train()
    feats = torch.cat(feats)
    sims = (feats[0::2] * feats[1::2]).sum(1).numpy()
    best = 0.0
    for th in np.linspace(-1, 1, 401):
        best = max(best, float(np.mean((sims > th) == issame)))
    return best


def main():
    args = build_parser().parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    train_tf = transforms.Compose([
        transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3)])
    train_set = datasets.ImageFolder(args.data, transform=train_tf)
    num_classes = len(train_set.classes)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    model = CosFaceNet(args.arch, args.emb_dim, num_classes, args.scale, args.margin).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    base_lr = args.lr * world_size * args.batch_size / 512
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=args.wd)
    scaler = GradScaler(enabled=args.amp)

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        if is_main:
            print(f"resumed from {args.resume} (epoch {checkpoint['epoch']})")
        del checkpoint

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    iters_per_epoch = len(loader)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = args.warmup_epochs * iters_per_epoch

    def lr_at(it):
        if it < warmup_iters:
            return base_lr * (it + 1) / warmup_iters
        progress = (it - warmup_iters) / max(1, total_iters - warmup_iters)
        return 0.5 * base_lr * (1 + math.cos(math.pi * progress))

    val_sets = {os.path.basename(p): load_bin(p) for p in args.val_bins if os.path.exists(p)} if is_main else {}
    if is_main:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{datetime.now()} world={world_size} classes={num_classes} images={len(train_set)} lr={base_lr:.4f}")

    criterion = nn.CrossEntropyLoss()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, labels) in enumerate(loader):
            it = epoch * iters_per_epoch + i
            for group in optimizer.param_groups:
                group["lr"] = lr_at(it)
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with autocast(enabled=args.amp):
                logits = model(images, labels)
            loss = criterion(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if is_main and i % 200 == 0:
                print(f"ep {epoch} it {i}/{iters_per_epoch} loss {loss.item():.4f} "
                      f"lr {lr_at(it):.5f} {time.time() - t0:.1f}s", flush=True)

        if is_main:
            for name, (imgs, issame) in val_sets.items():
                acc = eval_verification(model.module.backbone, imgs, issame, device)
                print(f"ep {epoch} {name}: {acc * 100:.2f}%", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.ckpt_dir, f"checkpoint_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
