"""Kinetics-400 / SSv2 fine-tuning of an R(2+1)D-18 with decord readers.

    torchrun --nproc_per_node=8 04_video_decord_ddp.py --root /data/k400 --epochs 45
"""
import argparse
import math
import os
import random
import time

import decord
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import r2plus1d_18

decord.bridge.set_bridge("native")

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--train-list", default="train.csv")
    ap.add_argument("--val-list", default="val.csv")
    ap.add_argument("--num-classes", type=int, default=400)
    ap.add_argument("--clip-len", type=int, default=16)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--crop", type=int, default=112)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--workers", type=int, default=8, help="per GPU")
    ap.add_argument("--epochs", type=int, default=45)
    ap.add_argument("--lr", type=float, default=0.01, help="for a global batch of 64")
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="work_dirs/r2p1d_k400")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class VideoClips(Dataset):
    def __init__(self, root, listfile, clip_len, stride, crop, train):
        self.root, self.clip_len, self.stride, self.crop, self.train = root, clip_len, stride, crop, train
        self.items = []
        with open(os.path.join(root, listfile)) as f:
            for line in f:
                path, label = line.strip().rsplit(",", 1)
                self.items.append((path, int(label)))

    def __len__(self):
        return len(self.items)

    def _indices(self, n):
        span = self.clip_len * self.stride
        if n <= span:
            start = 0
        elif self.train:
            start = random.randint(0, n - span)
        else:
            start = (n - span) // 2
        idx = np.arange(start, start + span, self.stride)
        return np.clip(idx, 0, n - 1)

    def __getitem__(self, i):
        path, label = self.items[i]
        vr = decord.VideoReader(os.path.join(self.root, path), width=171, height=128, num_threads=1)
        frames = vr.get_batch(self._indices(len(vr))).asnumpy()  # T H W C uint8
        x = torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 255.0  # C T H W
        _, _, h, w = x.shape
        if self.train:
            top, left = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            x = x[:, :, top:top + self.crop, left:left + self.crop]
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            top, left = (h - self.crop) // 2, (w - self.crop) // 2
            x = x[:, :, top:top + self.crop, left:left + self.crop]
        x = (x - MEAN) / STD
        return x, label


class ShardSampler(Sampler):
    """Every sample exactly once over all ranks (no padding), for evaluation."""

    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def cosine_lr(opt, base_lr, epoch_f, warmup, total):
    if epoch_f < warmup:
        lr = base_lr * epoch_f / warmup
    else:
        lr = 0.5 * base_lr * (1 + math.cos(math.pi * (epoch_f - warmup) / (total - warmup)))
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def train_one_epoch(model, loader, opt, scaler, epoch, args, base_lr, device, rank):
    model.train()
    t0 = time.time()
    n_iter = len(loader)
    for it, (x, y) in enumerate(loader):
        lr = cosine_lr(opt, base_lr, epoch + it / n_iter, args.warmup, args.epochs)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if rank == 0 and it % 50 == 0:
            print(f"ep {epoch} it {it}/{n_iter} loss {loss.item():.4f} lr {lr:.5f} {time.time() - t0:.1f}s", flush=True)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct@1, correct@5, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        stats[0] += (top5[:, 0] == y).sum()
        stats[1] += (top5 == y[:, None]).any(dim=1).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    train_set = VideoClips(args.root, args.train_list, args.clip_len, args.stride, args.crop, train=True)
    val_set = VideoClips(args.root, args.val_list, args.clip_len, args.stride, args.crop, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=ShardSampler(len(val_set), rank, world),
                            num_workers=args.workers, pin_memory=True)

    model = r2plus1d_18(num_classes=args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt.get("best", 0.0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} global batch={args.batch_size * world} lr={base_lr:.4f} "
              f"train clips={len(train_set)} val clips={len(val_set)}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, train_loader, opt, scaler, epoch, args, base_lr, device, rank)
        top1, top5 = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: top1 {top1 * 100:.2f} top5 {top5 * 100:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "best": max(best, top1)}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if top1 > best:
                torch.save(state, os.path.join(args.out, "best.pth"))
        best = max(best, top1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
