"""Cricket delivery-outcome recognition from full-match broadcast video.

Full innings videos (3-4 h each) are cut into overlapping 8 s clips; each clip
gets the outcome of the delivery whose bowler release falls inside it
(dot / runs / boundary-4 / boundary-6 / wicket), or `none` for replays, crowd
shots and between-over footage. S3D (Kinetics-400 init) classifies the clips.

    torchrun --nproc_per_node=4 09_cricket_delivery_clips_s3d.py \
        --videos /mnt/sports/cricket/videos --deliveries /mnt/sports/cricket/deliveries.csv
"""
import argparse
import os
import pickle
import random
from pathlib import Path

import decord
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import S3D_Weights, s3d

OUTCOMES = ["none", "dot", "runs", "four", "six", "wicket"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--videos", type=Path, required=True)
    p.add_argument("--deliveries", type=Path, required=True,
                   help="csv: match_id,video,release_sec,outcome,split")
    p.add_argument("--cache-dir", type=Path, default=Path("cache"))
    p.add_argument("--clip-sec", type=float, default=8.0)
    p.add_argument("--hop-sec", type=float, default=4.0)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05, help="SGD lr at global batch 64")
    p.add_argument("--none-keep", type=float, default=0.2, help="fraction of 'none' clips kept for training")
    p.add_argument("--out", type=Path, default=Path("runs/cricket_s3d"))
    return p.parse_args()


def build_clip_index(videos_dir, deliveries, split, clip_sec, hop_sec):
    """Scan every video once (frame count / fps) and label the sliding-window clips."""
    rows = []
    df = deliveries[deliveries.split == split]
    for video, d in df.groupby("video"):
        vr = decord.VideoReader(str(videos_dir / video))
        fps, n = vr.get_avg_fps(), len(vr)
        duration = n / fps
        releases = d.sort_values("release_sec")[["release_sec", "outcome"]].to_numpy()
        t = 0.0
        while t + clip_sec <= duration:
            inside = [o for r, o in releases if t + 1.0 <= r <= t + clip_sec - 2.0]
            rows.append({"video": video, "start": t, "fps": fps, "label": OUTCOMES.index(inside[0]) if inside else 0})
            t += hop_sec
    return rows


def get_clip_index(args, split):
    cache = args.cache_dir / f"clips_{split}_{args.clip_sec:g}s_{args.hop_sec:g}s.pkl"
    if cache.exists():
        with open(cache, "rb") as f:
            return pickle.load(f)
    deliveries = pd.read_csv(args.deliveries)
    rows = build_clip_index(args.videos, deliveries, split, args.clip_sec, args.hop_sec)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(rows, f)
    return rows


class CricketClips(Dataset):
    def __init__(self, videos_dir, rows, frames, clip_sec, train):
        self.videos_dir, self.rows = videos_dir, rows
        self.frames, self.clip_sec, self.train = frames, clip_sec, train
        self.mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        vr = decord.VideoReader(str(self.videos_dir / r["video"]), width=398, height=224, num_threads=2)
        s = int(r["start"] * r["fps"])
        e = min(len(vr) - 1, int((r["start"] + self.clip_sec) * r["fps"]))
        idx = np.linspace(s, e, self.frames).astype(int)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        if self.train:
            top, left = 0, random.randint(0, 398 - 224)
        else:
            top, left = 0, (398 - 224) // 2
        x = x[:, :, top:top + 224, left:left + 224]
        return (x - self.mean) / self.std, r["label"]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    decord.bridge.reset_bridge()

    train_rows = get_clip_index(args, "train")
    val_rows = get_clip_index(args, "val")
    # subsample background clips with a fixed rng so all ranks keep the same list
    rng = random.Random(0)
    train_rows = [r for r in train_rows if r["label"] != 0 or rng.random() < args.none_keep]

    train_ds = CricketClips(args.videos, train_rows, args.frames, args.clip_sec, train=True)
    val_ds = CricketClips(args.videos, val_rows[rank::world], args.frames, args.clip_sec, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=8, pin_memory=True)

    model = s3d(weights=S3D_Weights.KINETICS400_V1)
    model.classifier[1] = nn.Conv3d(1024, len(OUTCOMES), kernel_size=1, stride=1, bias=True)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    counts = np.bincount([r["label"] for r in train_rows], minlength=len(OUTCOMES)).astype(np.float32)
    class_w = torch.tensor((counts.sum() / np.maximum(counts, 1)) ** 0.5, device=device)
    class_w = class_w / class_w.mean()

    lr = args.lr * args.bs * world / 64
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"train clips {len(train_rows)}  val clips {len(val_rows)}  class counts {counts.tolist()}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits, y, weight=class_w)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        cm = torch.zeros(len(OUTCOMES), len(OUTCOMES), dtype=torch.long, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for x, y in val_dl:
                pred = model.module(x.to(device, non_blocking=True)).argmax(1)
                y = y.to(device)
                cm += torch.bincount(y * len(OUTCOMES) + pred, minlength=len(OUTCOMES) ** 2).view_as(cm)
        dist.all_reduce(cm)
        recall = cm.diag().float() / cm.sum(1).clamp(min=1).float()
        bal_acc = recall.mean().item()
        if rank == 0:
            print(f"epoch {epoch}: balanced acc {bal_acc:.4f} per-class {[round(v, 3) for v in recall.tolist()]}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.out / "last.pth")
            if bal_acc > best:
                best = bal_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.out / "best.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
