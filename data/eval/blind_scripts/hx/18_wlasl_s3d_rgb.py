"""Isolated sign recognition on WLASL (100/300/1000/2000) with an S3D RGB backbone.

Usage:
    torchrun --nproc_per_node=8 18_wlasl_s3d_rgb.py --subset 2000 --video-root /data/WLASL/videos
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import S3D_Weights, s3d


def get_args():
    parser = argparse.ArgumentParser(description="WLASL S3D")
    parser.add_argument("--video-root", default="/data/WLASL/videos")
    parser.add_argument("--split-file", default="/data/WLASL/WLASL_v0.3.json")
    parser.add_argument("--subset", type=int, default=2000, choices=[100, 300, 1000, 2000])
    parser.add_argument("--clip-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=6, help="clips per GPU")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3, help="lr for a global batch of 48")
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--output-dir", default="checkpoints/wlasl_s3d")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def load_wlasl(split_file, subset):
    with open(split_file) as f:
        content = json.load(f)[:subset]  # entries are ordered by number of instances
    splits = {"train": [], "val": [], "test": []}
    for label, entry in enumerate(content):
        for inst in entry["instances"]:
            splits[inst["split"]].append((inst["video_id"], label, inst["frame_start"], inst["frame_end"]))
    return splits, [e["gloss"] for e in content]


class WLASLClips(Dataset):
    def __init__(self, root, items, clip_len, train):
        self.root = root
        self.items = [it for it in items if os.path.exists(os.path.join(root, it[0] + ".mp4"))]
        self.clip_len = clip_len
        self.train = train
        self.mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def _indices(self, start, end):
        n = end - start + 1
        if n >= self.clip_len:
            off = random.randint(0, n - self.clip_len) if self.train else (n - self.clip_len) // 2
            return np.arange(start + off, start + off + self.clip_len)
        # short sign: loop-pad the clip
        idx = np.arange(start, end + 1)
        return np.resize(idx, self.clip_len)

    def __getitem__(self, i):
        vid, label, fs, fe = self.items[i]
        vr = VideoReader(os.path.join(self.root, vid + ".mp4"), ctx=cpu(0))
        start = max(fs - 1, 0)
        end = len(vr) - 1 if fe == -1 else min(fe - 1, len(vr) - 1)
        frames = vr.get_batch(self._indices(start, end).tolist()).asnumpy()  # T H W C
        x = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 255.0
        x = F.interpolate(x, size=(256, 256), mode="bilinear", align_corners=False)
        if self.train:
            t, l = random.randint(0, 32), random.randint(0, 32)
            x = x[:, :, t:t + 224, l:l + 224]
        else:
            x = x[:, :, 16:240, 16:240]
        return (x - self.mean) / self.std, label


def build_model(num_classes):
    model = s3d(weights=S3D_Weights.KINETICS400_V1)
    model.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv3d(1024, num_classes, kernel_size=1, stride=1, bias=True))
    return model


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        counts[0] += (top5[:, 0] == y).sum()
        counts[1] += (top5 == y[:, None]).any(1).sum()
        counts[2] += y.numel()
    dist.all_reduce(counts)
    return (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    is_main = rank == 0

    splits, glosses = load_wlasl(args.split_file, args.subset)
    train_set = WLASLClips(args.video_root, splits["train"], args.clip_len, train=True)
    val_set = WLASLClips(args.video_root, splits["val"], args.clip_len, train=False)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = build_model(len(glosses))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * args.batch_size * world_size / 48
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    warmup = 3 * len(train_loader)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(train_set)} train / {len(val_set)} val clips, {len(glosses)} glosses, world size {world_size}")

    best_top1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if is_main and step % 50 == 0:
                print(f"[{epoch}][{step}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - tic:.0f}s", flush=True)

        top1, top5 = evaluate(model, val_loader, device)
        if is_main:
            print(f"epoch {epoch} val top1 {top1 * 100:.2f} top5 {top5 * 100:.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "glosses": glosses}
            torch.save(ckpt, os.path.join(args.output_dir, "last.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(ckpt, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
