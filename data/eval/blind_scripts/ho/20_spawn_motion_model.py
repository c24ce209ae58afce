"""Learned motion model for tracking-by-detection on DanceTrack / SportsMOT.

A small transformer reads the last K boxes of a trajectory and predicts the box in the
next frame; it replaces the Kalman filter prediction step of ByteTrack/OC-SORT style
trackers. Only gt.txt files are needed, so each process reads just its own videos.

    python 20_spawn_motion_model.py --gpus 8 --data /data/DanceTrack
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision.ops import box_convert, box_iou


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/DanceTrack")
    p.add_argument("--out", default="checkpoints/motion_tf")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--history", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--port", default="29533")
    return p.parse_args()


def read_tracks(gt_path):
    """Returns {track_id: array[T, 5]} with rows (frame, cx, cy, w, h), normalised by image size."""
    seq_dir = os.path.dirname(os.path.dirname(gt_path))
    info = dict(l.strip().split("=") for l in open(os.path.join(seq_dir, "seqinfo.ini")) if "=" in l)
    W, H = float(info["imWidth"]), float(info["imHeight"])
    arr = np.loadtxt(gt_path, delimiter=",", ndmin=2)
    tracks = {}
    for tid in np.unique(arr[:, 1]):
        t = arr[arr[:, 1] == tid]
        t = t[np.argsort(t[:, 0])]
        cx, cy = (t[:, 2] + t[:, 4] / 2) / W, (t[:, 3] + t[:, 5] / 2) / H
        tracks[int(tid)] = np.stack([t[:, 0], cx, cy, t[:, 4] / W, t[:, 5] / H], 1).astype(np.float32)
    return tracks


class TrajectoryWindows(Dataset):
    def __init__(self, gt_files, history, train=True):
        self.samples, self.history, self.train = [], history, train
        for g in gt_files:
            for traj in read_tracks(g).values():
                for end in range(history, len(traj)):
                    if traj[end, 0] - traj[end - history, 0] == history:  # no gaps in the window
                        self.samples.append(traj[end - history : end + 1, 1:])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        w = self.samples[i].copy()
        if self.train and random.random() < 0.5:
            w[:, 0] = 1.0 - w[:, 0]
        hist = w[:-1]
        deltas = np.diff(hist, axis=0, prepend=hist[:1])
        return torch.from_numpy(np.concatenate([hist, deltas], 1)), torch.from_numpy(w[-1] - w[-2]), torch.from_numpy(w[-2:])


def stack_batch(batch):
    x, y, boxes = zip(*batch)
    return torch.stack(x), torch.stack(y), torch.stack(boxes)


class MotionTransformer(nn.Module):
    def __init__(self, history, dim=128):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.pos = nn.Parameter(torch.zeros(1, history, dim))
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 4, 4 * dim, 0.1, batch_first=True, norm_first=True), 4)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4))

    def forward(self, x):
        h = self.enc(self.inp(x) + self.pos)
        return self.head(h[:, -1])


def iou_of(pred_delta, boxes):
    pred = box_convert(boxes[:, 0] + pred_delta, "cxcywh", "xyxy")
    gt = box_convert(boxes[:, 1], "cxcywh", "xyxy")
    return box_iou(pred, gt).diag()


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    random.seed(rank)

    # whole videos per process: the number of windows per rank differs, Join evens out the last steps
    train_gts = sorted(glob.glob(os.path.join(args.data, "train", "*", "gt", "gt.txt")))
    val_gts = sorted(glob.glob(os.path.join(args.data, "val", "*", "gt", "gt.txt")))
    train_set = TrajectoryWindows(train_gts[rank::world_size], args.history)
    val_set = TrajectoryWindows(val_gts[rank::world_size], args.history, train=False)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4,
                        collate_fn=stack_batch, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1024, num_workers=2, collate_fn=stack_batch)

    model = DDP(MotionTransformer(args.history).to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_iou = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        with Join([model]):
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(x)
                loss = F.smooth_l1_loss(pred.float(), y, beta=0.01)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                stats += torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)), device=device)])
        scheduler.step()
        dist.all_reduce(stats)

        model.eval()
        ious = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, _, boxes in val_loader:
                pred = model.module(x.to(device)).float()
                iou = iou_of(pred, boxes.to(device))
                ious += torch.stack([iou.sum(), torch.tensor(float(len(iou)), device=device)])
        dist.all_reduce(ious)
        mean_iou = (ious[0] / ious[1].clamp(min=1)).item()
        if rank == 0:
            print(f"epoch {epoch:02d} train loss {(stats[0] / stats[1]).item():.5f} val next-box IoU {mean_iou:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "history": args.history, "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
            if mean_iou > best_iou:
                best_iou = mean_iou
                torch.save({"model": model.module.state_dict(), "history": args.history, "epoch": epoch},
                           os.path.join(args.out, "best.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
