"""X3D-M on Kinetics-400 (our re-downloaded copy, which has a fair number of broken files).

    torchrun --nproc_per_node=8 09_x3d_robust_decode.py --root /data/k400 --out /exp/x3d_m
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.x3d import create_x3d
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("x3d")

MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="contains train.csv, val.csv, train/ and val/")
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--rate", type=int, default=5)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--batch-size", type=int, default=8, help="clips per GPU")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--warmup-epochs", type=int, default=35)
    ap.add_argument("--lr", type=float, default=1.6, help="for a global batch of 1024")
    ap.add_argument("--wd", type=float, default=5e-5)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=10)
    return ap.parse_args()


def read_csv(path, video_dir, class_to_idx=None):
    rows = []
    with open(path) as f:
        next(f)  # header: label,youtube_id,time_start,time_end,split,is_cc
        for line in f:
            label, yid, t0, t1 = line.strip().split(",")[:4]
            rows.append((os.path.join(video_dir, label, f"{yid}_{int(t0):06d}_{int(t1):06d}.mp4"), label))
    if class_to_idx is None:
        class_to_idx = {c: i for i, c in enumerate(sorted({lab for _, lab in rows}))}
    return [(p, class_to_idx[lab]) for p, lab in rows], class_to_idx


class KineticsX3D(Dataset):
    def __init__(self, rows, frames, rate, crop, train):
        self.rows, self.frames, self.rate, self.crop, self.train = rows, frames, rate, crop, train

    def __len__(self):
        return len(self.rows)

    def load(self, path):
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n, span = len(vr), self.frames * self.rate
        s = random.randint(0, max(0, n - span)) if self.train else max(0, n - span) // 2
        ids = np.clip(np.arange(s, s + span, self.rate), 0, n - 1)
        return torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0

    def __getitem__(self, i):
        path, label = self.rows[i]
        try:
            x = self.load(path)
        except Exception as e:  # truncated / undecodable downloads
            logger.warning("skipping %s: %s", path, e)
            return None
        short = random.randint(256, 320) if self.train else 256
        h, w = x.shape[-2:]
        r = short / min(h, w)
        x = F.interpolate(x, size=(round(h * r), round(w * r)), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            t, l = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        else:
            t, l = (h - self.crop) // 2, (w - self.crop) // 2
        x = x[..., t:t + self.crop, l:l + self.crop]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return (x.transpose(0, 1) - MEAN) / STD, label


def collate_skip_none(batch):
    batch = [b for b in batch if b is not None]
    if not batch:
        return None
    return default_collate(batch)


class ShardNoPad(torch.utils.data.Sampler):
    def __init__(self, n, world, rank):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hits = torch.zeros(2, device=device)
    for batch in loader:
        if batch is None:
            continue
        x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(1)
        hits[0] += (pred == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return (100 * hits[0] / hits[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    random.seed(rank)
    torch.manual_seed(rank)

    train_rows, class_to_idx = read_csv(os.path.join(args.root, "train.csv"), os.path.join(args.root, "train"))
    val_rows, _ = read_csv(os.path.join(args.root, "val.csv"), os.path.join(args.root, "val"), class_to_idx)
    train_ds = KineticsX3D(train_rows, args.frames, args.rate, args.crop, train=True)
    val_ds = KineticsX3D(val_rows, args.frames, args.rate, args.crop, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          collate_fn=collate_skip_none, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=ShardNoPad(len(val_ds), world, rank),
                        num_workers=args.workers, collate_fn=collate_skip_none, pin_memory=True)

    model = create_x3d(input_clip_length=args.frames, input_crop_size=args.crop,
                       model_num_class=len(class_to_idx), depth_factor=2.2, head_activation=None)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    base_lr = args.lr * args.batch_size * world / 1024
    bn_params = [p for n, p in model.named_parameters() if "norm" in n or p.ndim == 1]
    other = [p for n, p in model.named_parameters() if not ("norm" in n or p.ndim == 1)]
    optimizer = torch.optim.SGD([{"params": other, "weight_decay": args.wd},
                                 {"params": bn_params, "weight_decay": 0.0}],
                                lr=base_lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()
    iters = len(train_dl)
    warmup, total = args.warmup_epochs * iters, args.epochs * iters

    start_epoch = 0
    resume = os.path.join(args.out, "last.pth")
    if os.path.exists(resume):
        ck = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    logger.info("global batch %d, base lr %.3f, %d iters/epoch", args.batch_size * world, base_lr, iters)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for it, batch in enumerate(train_dl):
            if batch is None or batch[1].numel() < 2:
                continue
            step = epoch * iters + it
            lr = base_lr * step / warmup if step < warmup else \
                base_lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            run += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if it % 50 == 0:
                logger.info("ep %d it %d/%d loss %.4f lr %.4f", epoch, it, iters, loss.item(), lr)
        dist.all_reduce(run)
        logger.info("epoch %d train loss %.4f", epoch, (run[0] / run[1]).item())

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            acc = evaluate(model.module, val_dl, device)
            logger.info("epoch %d val top1 %.2f (center clip)", epoch, acc)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, resume + ".tmp")
            os.replace(resume + ".tmp", resume)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
