"""Fine-tune torchvision MViTv2-S (Kinetics-400 weights) on our warehouse-actions clips.

annotations.csv:
    video,label
    cam03/2023-05-11/000123.mp4,pick_item
    ...
There is no official split, so we hold out --val-ratio of the clips for validation.

    torchrun --nproc_per_node=8 06_mvit_custom_actions.py --csv /data/wh_actions/annotations.csv \
        --video-root /data/wh_actions/clips --weights /models/mvit_v2_s-ae3be167.pth
"""
import argparse
import csv
import math
import os
import random
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import mvit_v2_s

MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--video-root", required=True)
    p.add_argument("--weights", default="")
    p.add_argument("--val-ratio", type=float, default=0.1)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW lr for a global batch of 32")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="/data/wh_actions/runs/mvit_s")
    p.add_argument("--wandb-project", default="wh-actions")
    return p.parse_args()


def read_annotations(path, video_root):
    with open(path) as f:
        rows = [(os.path.join(video_root, r["video"]), r["label"]) for r in csv.DictReader(f)]
    return rows


class ClipDataset(Dataset):
    def __init__(self, rows, class_to_idx, frames, stride, train, size=224):
        self.rows, self.class_to_idx = rows, class_to_idx
        self.frames, self.stride, self.train, self.size = frames, stride, train, size

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, label = self.rows[i]
        vr = VideoReader(path, ctx=cpu(0), num_threads=2)
        n = len(vr)
        span = (self.frames - 1) * self.stride + 1
        if n < span:
            idx = np.linspace(0, n - 1, self.frames).round().astype(int)
        else:
            s = random.randint(0, n - span) if self.train else (n - span) // 2
            idx = np.arange(s, s + span, self.stride)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        if self.train:
            scale = random.uniform(0.6, 1.0)
            ch, cw = int(min(h, w) * scale), int(min(h, w) * scale)
            t, l = random.randint(0, h - ch), random.randint(0, w - cw)
            x = x[..., t:t + ch, l:l + cw]
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            c = min(h, w)
            x = x[..., (h - c) // 2:(h - c) // 2 + c, (w - c) // 2:(w - c) // 2 + c]
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        x = (x.permute(1, 0, 2, 3) - MEAN) / STD
        return x, self.class_to_idx[label]


class EvalSampler(torch.utils.data.Sampler):
    def __init__(self, n, num_replicas, rank):
        self.idx = list(range(rank, n, num_replicas))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


@torch.no_grad()
def evaluate(model, loader, num_classes, device):
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        confusion += torch.bincount(y * num_classes + pred, minlength=num_classes ** 2).view(num_classes, -1)
    dist.all_reduce(confusion)
    per_class = confusion.diag().float() / confusion.sum(1).clamp(min=1).float()
    top1 = confusion.diag().sum().float() / confusion.sum().float()
    return top1.item() * 100, per_class.mean().item() * 100


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    # different augmentation streams per rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    rows = read_annotations(args.csv, args.video_root)
    classes = sorted({label for _, label in rows})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    random.shuffle(rows)
    n_val = int(len(rows) * args.val_ratio)
    val_rows, train_rows = rows[:n_val], rows[n_val:]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)
        counts = Counter(label for _, label in train_rows)
        print(f"{len(classes)} classes, {len(train_rows)} train / {len(val_rows)} val clips; "
              f"rarest class has {min(counts.values())} train clips", flush=True)

    train_ds = ClipDataset(train_rows, class_to_idx, args.frames, args.stride, train=True)
    val_ds = ClipDataset(val_rows, class_to_idx, args.frames, args.stride, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size,
                            sampler=EvalSampler(len(val_ds), world_size, rank),
                            num_workers=args.workers, pin_memory=True)

    model = mvit_v2_s()
    if args.weights:
        model.load_state_dict(torch.load(args.weights, map_location="cpu"))
    model.head[1] = nn.Linear(model.head[1].in_features, len(classes))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 32
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or "pos" in name or "rel_pos" in name else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    iters = len(train_loader)
    warmup, total = args.warmup_epochs * iters, args.epochs * iters
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss_step": loss.item(), "lr": scheduler.get_last_lr()[0]},
                          step=epoch * iters + step)
        dist.all_reduce(loss_acc)
        top1, mean_class = evaluate(model.module, val_loader, len(classes), device)
        if rank == 0:
            wandb.log({"train/loss": (loss_acc[0] / loss_acc[1]).item(), "val/top1": top1,
                       "val/mean_class_acc": mean_class, "epoch": epoch}, step=(epoch + 1) * iters)
            print(f"epoch {epoch}: val top1 {top1:.2f} mean-class {mean_class:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "classes": classes, "epoch": epoch}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if top1 > best:
                best = top1
                torch.save(state, os.path.join(args.out, "best.pt"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
