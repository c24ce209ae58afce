#!/usr/bin/env python3
"""R(2+1)D-18 on Kinetics-400 with DistributedDataParallel.

Annotations are the official Kinetics CSVs (label,youtube_id,time_start,time_end,split)
and the trimmed clips live in <data-root>/<split>/<label>/<youtube_id>_<start>_<end>.mp4.

    torchrun --nproc_per_node=8 01_r2plus1d_k400.py --data-root /data/k400 \
        --train-csv /data/k400/annotations/train.csv --val-csv /data/k400/annotations/validate.csv --amp
"""
import argparse
import csv
import math
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
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.video import r2plus1d_18

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


def parse_args():
    p = argparse.ArgumentParser(description="R(2+1)D Kinetics training")
    p.add_argument("--data-root", required=True)
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--num-classes", type=int, default=400)
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--sampling-rate", type=int, default=4)
    p.add_argument("--crop-size", type=int, default=112)
    p.add_argument("--batch-size", type=int, default=32, help="clips per GPU")
    p.add_argument("--epochs", type=int, default=45)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--test-clips", type=int, default=10)
    p.add_argument("--test-crops", type=int, default=3)
    p.add_argument("--output-dir", default="./work_dirs/r2plus1d_k400")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


def read_annotations(csv_path, root, split):
    items = []
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            name = "{}_{:06d}_{:06d}.mp4".format(
                row["youtube_id"], int(row["time_start"]), int(row["time_end"]))
            items.append((os.path.join(root, split, row["label"], name), row["label"]))
    return items


def resize_short_side(x, size):
    # x: (C, T, H, W)
    _, _, h, w = x.shape
    if h < w:
        nh, nw = size, int(round(w * size / h))
    else:
        nh, nw = int(round(h * size / w)), size
    x = F.interpolate(x.permute(1, 0, 2, 3), size=(nh, nw), mode="bilinear", align_corners=False)
    return x.permute(1, 0, 2, 3)


class KineticsClips(Dataset):
    def __init__(self, items, class_to_idx, num_frames, rate, crop, train, num_clips=1, num_crops=1):
        self.items = items
        self.class_to_idx = class_to_idx
        self.num_frames = num_frames
        self.rate = rate
        self.crop = crop
        self.train = train
        self.num_clips = num_clips
        self.num_crops = num_crops

    def __len__(self):
        return len(self.items) * self.num_clips * self.num_crops

    def _frame_indices(self, n, clip_idx):
        span = self.num_frames * self.rate
        if self.train:
            start = random.randint(0, max(n - span, 0))
        elif self.num_clips == 1:
            start = max(n - span, 0) // 2
        else:
            start = int(round(max(n - span, 0) * clip_idx / (self.num_clips - 1)))
        return np.clip(np.arange(start, start + span, self.rate), 0, n - 1)

    def __getitem__(self, index):
        video_idx, view = divmod(index, self.num_clips * self.num_crops)
        clip_idx, crop_idx = divmod(view, self.num_crops)
        path, label = self.items[video_idx]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        frames = vr.get_batch(self._frame_indices(len(vr), clip_idx)).asnumpy()
        x = torch.from_numpy(frames).permute(3, 0, 1, 2).float().div_(255.0)
        if self.train:
            x = resize_short_side(x, random.randint(128, 160))
            _, _, h, w = x.shape
            i = random.randint(0, h - self.crop)
            j = random.randint(0, w - self.crop)
            x = x[:, :, i:i + self.crop, j:j + self.crop]
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            x = resize_short_side(x, self.crop)
            _, _, h, w = x.shape
            pos = 1 if self.num_crops == 1 else crop_idx
            # spatial crops slide along the long side
            i = (h - self.crop) * pos // 2 if h > w else (h - self.crop) // 2
            j = (w - self.crop) * pos // 2 if w >= h else (w - self.crop) // 2
            x = x[:, :, i:i + self.crop, j:j + self.crop]
        x = (x - MEAN) / STD
        return x, self.class_to_idx[label], video_idx


class ShardedEvalSampler(Sampler):
    """Strided split of the eval set, no padding: every view is scored exactly once."""

    def __init__(self, dataset, num_replicas, rank):
        self.indices = list(range(rank, len(dataset), num_replicas))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def cosine_with_warmup(base_lr, warmup_iters, total_iters):
    def lr_at(step):
        if step < warmup_iters:
            return base_lr * (step + 1) / warmup_iters
        t = (step - warmup_iters) / max(1, total_iters - warmup_iters)
        return 0.5 * base_lr * (1.0 + math.cos(math.pi * t))
    return lr_at


def train_one_epoch(model, loader, optimizer, scaler, criterion, lr_at, epoch, device, args, rank):
    model.train()
    iters = len(loader)
    stats = torch.zeros(2, device=device)
    end = time.time()
    for i, (clips, target, _) in enumerate(loader):
        lr = lr_at(epoch * iters + i)
        for g in optimizer.param_groups:
            g["lr"] = lr
        clips = clips.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with torch.cuda.amp.autocast(enabled=args.amp):
            loss = criterion(model(clips), target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        stats[0] += loss.detach() * clips.size(0)
        stats[1] += clips.size(0)
        if rank == 0 and i % args.print_freq == 0:
            print(f"epoch {epoch} [{i}/{iters}] loss {loss.item():.4f} lr {lr:.5f} "
                  f"{(time.time() - end) / (i + 1):.3f}s/it", flush=True)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def evaluate(net, loader, num_videos, num_classes, device, amp):
    """Video-level accuracy: softmax scores averaged over all views of a video."""
    net.eval()
    scores = torch.zeros(num_videos, num_classes, device=device)
    counts = torch.zeros(num_videos, device=device)
    labels = torch.full((num_videos,), -1, dtype=torch.long, device=device)
    for clips, target, vid in loader:
        clips = clips.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        vid = vid.to(device, non_blocking=True)
        with torch.cuda.amp.autocast(enabled=amp):
            logits = net(clips)
        scores.index_add_(0, vid, logits.float().softmax(dim=1))
        counts.index_add_(0, vid, torch.ones_like(vid, dtype=torch.float))
        labels[vid] = target
    dist.all_reduce(scores)
    dist.all_reduce(counts)
    dist.all_reduce(labels, op=dist.ReduceOp.MAX)
    seen = counts > 0
    video_scores = scores[seen] / counts[seen].unsqueeze(1)
    video_labels = labels[seen]
    top1 = (video_scores.argmax(1) == video_labels).float().mean().item() * 100
    top5 = (video_scores.topk(5, dim=1).indices == video_labels[:, None]).any(1).float().mean().item() * 100
    return top1, top5


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    train_items = read_annotations(args.train_csv, args.data_root, "train")
    val_items = read_annotations(args.val_csv, args.data_root, "val")
    classes = sorted({label for _, label in train_items})
    assert len(classes) == args.num_classes, f"found {len(classes)} classes"
    class_to_idx = {c: i for i, c in enumerate(classes)}

    train_set = KineticsClips(train_items, class_to_idx, args.num_frames, args.sampling_rate,
                              args.crop_size, train=True)
    val_set = KineticsClips(val_items, class_to_idx, args.num_frames, args.sampling_rate,
                            args.crop_size, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size,
                            sampler=ShardedEvalSampler(val_set, world_size, rank),
                            num_workers=args.workers, pin_memory=True)

    model = r2plus1d_18(num_classes=args.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model_without_ddp = model.module

    lr = args.base_lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay, nesterov=True)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    iters_per_epoch = len(train_loader)
    lr_at = cosine_with_warmup(lr, args.warmup_epochs * iters_per_epoch, args.epochs * iters_per_epoch)

    start_epoch, best_top1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
        best_top1 = ckpt.get("best_top1", 0.0)

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output_dir, "tb"))
        print(f"world size {world_size}, {len(train_set)} train clips, "
              f"{iters_per_epoch} iters/epoch, lr {lr:.4f}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_loss = train_one_epoch(model, train_loader, optimizer, scaler, criterion, lr_at,
                                     epoch, device, args, rank)
        top1 = None
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            top1, top5 = evaluate(model_without_ddp, val_loader, len(val_items), args.num_classes,
                                  device, args.amp)
        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            state = {"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best_top1": best_top1,
                     "args": vars(args)}
            if top1 is not None:
                writer.add_scalar("val/top1", top1, epoch)
                writer.add_scalar("val/top5", top5, epoch)
                print(f"epoch {epoch}: val top1 {top1:.2f} top5 {top5:.2f}", flush=True)
                if top1 > best_top1:
                    best_top1 = top1
                    state["best_top1"] = best_top1
                    torch.save(state, os.path.join(args.output_dir, "best.pth"))
            torch.save(state, os.path.join(args.output_dir, "last.pth"))

    # multi-clip, multi-crop test with the final weights
    test_set = KineticsClips(val_items, class_to_idx, args.num_frames, args.sampling_rate,
                             args.crop_size, train=False, num_clips=args.test_clips,
                             num_crops=args.test_crops)
    test_loader = DataLoader(test_set, batch_size=args.batch_size,
                             sampler=ShardedEvalSampler(test_set, world_size, rank),
                             num_workers=args.workers, pin_memory=True)
    top1, top5 = evaluate(model_without_ddp, test_loader, len(val_items), args.num_classes,
                          device, args.amp)
    if rank == 0:
        print(f"test {args.test_clips}x{args.test_crops} views: top1 {top1:.2f} top5 {top5:.2f}")
        writer.add_scalar("test/top1", top1, args.epochs)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
