"""Pose-based isolated sign recognition (WLASL-2000) with a SL-GCN style network.

Keypoints were extracted with MediaPipe Holistic and reduced to 27 points
(7 upper body + 2 x 10 hand points); each video is one entry of a pickle:
    {"video_id": str, "gloss_id": int, "kps": float32 (T, 27, 3)}   # x, y, confidence
"""
import argparse
import json
import math
import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_JOINTS = 27
BODY = [(0, 1), (0, 2), (1, 3), (3, 5), (2, 4), (4, 6)]
HAND = [(0, 1), (1, 2), (0, 3), (3, 4), (0, 5), (5, 6), (0, 7), (7, 8), (0, 9)]
EDGES = BODY + [(5, 7)] + [(7 + a, 7 + b) for a, b in HAND] + [(6, 17)] + [(17 + a, 17 + b) for a, b in HAND]


def build_adjacency():
    a = np.eye(N_JOINTS, dtype=np.float32)
    for i, j in EDGES:
        a[i, j] = a[j, i] = 1.0
    d = np.power(a.sum(1), -0.5)
    return (d[:, None] * a * d[None, :]).astype(np.float32)


class PoseClips(Dataset):
    def __init__(self, pkl_path, num_frames=64, train=True):
        with open(pkl_path, "rb") as f:
            self.items = pickle.load(f)
        self.num_frames = num_frames
        self.train = train

    def __len__(self):
        return len(self.items)

    def _sample(self, t):
        if self.train:
            # random temporal crop then uniform resample to num_frames
            span = max(int(t * np.random.uniform(0.8, 1.0)), 1)
            start = np.random.randint(0, t - span + 1)
            return np.linspace(start, start + span - 1, self.num_frames).round().astype(np.int64)
        return np.linspace(0, t - 1, self.num_frames).round().astype(np.int64)

    def __getitem__(self, i):
        item = self.items[i]
        kps = item["kps"]
        kps = kps[self._sample(len(kps))].copy()
        xy, conf = kps[..., :2], kps[..., 2:]
        # normalise by shoulder width, centre on the neck (mid-shoulder)
        neck = (xy[:, 1] + xy[:, 2]) / 2
        width = np.linalg.norm(xy[:, 1] - xy[:, 2], axis=-1).mean() + 1e-4
        xy = (xy - neck[:, None]) / width
        if self.train:
            xy = xy * np.random.uniform(0.9, 1.1) + np.random.normal(0, 0.01, xy.shape)
            if np.random.rand() < 0.5:
                xy[..., 0] = -xy[..., 0]
        x = np.concatenate([xy, conf], -1).transpose(2, 0, 1).astype(np.float32)  # C, T, V
        return torch.from_numpy(x), item["gloss_id"]


class DecoupledGCN(nn.Module):
    def __init__(self, cin, cout, A, groups=8):
        super().__init__()
        self.groups = groups
        self.A = nn.Parameter(torch.from_numpy(A).unsqueeze(0).repeat(groups, 1, 1))
        self.lin = nn.Conv2d(cin, cout, 1)
        self.bn = nn.BatchNorm2d(cout)
        self.down = nn.Identity() if cin == cout else nn.Sequential(nn.Conv2d(cin, cout, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        n, _, t, v = x.shape
        y = self.lin(x)
        c = y.shape[1]
        y = y.view(n, self.groups, c // self.groups, t, v)
        y = torch.einsum("ngctv,gvw->ngctw", y, self.A).reshape(n, c, t, v)
        return F.relu(self.bn(y) + self.down(x))


class Unit(nn.Module):
    def __init__(self, cin, cout, A, stride=1, drop=0.0):
        super().__init__()
        self.gcn = DecoupledGCN(cin, cout, A)
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.drop = nn.Dropout(drop)
        if cin == cout and stride == 1:
            self.res = nn.Identity()
        else:
            self.res = nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout))

    def forward(self, x):
        return self.drop(F.relu(self.tcn(self.gcn(x)) + self.res(x)))


class SLGCN(nn.Module):
    def __init__(self, num_class=2000, in_channels=3, width=64):
        super().__init__()
        A = build_adjacency()
        self.data_bn = nn.BatchNorm1d(in_channels * N_JOINTS)
        w = width
        cfg = [(in_channels, w, 1), (w, w, 1), (w, w, 1), (w, 2 * w, 2), (2 * w, 2 * w, 1),
               (2 * w, 4 * w, 2), (4 * w, 4 * w, 1), (4 * w, 4 * w, 1)]
        self.units = nn.Sequential(*[Unit(ci, co, A, s, 0.1 if k > 3 else 0.0) for k, (ci, co, s) in enumerate(cfg)])
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(4 * w, num_class))

    def forward(self, x):
        n, c, t, v = x.shape
        x = self.data_bn(x.permute(0, 3, 1, 2).reshape(n, v * c, t))
        x = x.view(n, v, c, t).permute(0, 2, 3, 1)
        x = self.units(x)
        return self.head(x.mean((2, 3)))


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    return 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def run_eval(net, loader, device):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = net(x).topk(5, 1).indices
            acc[0] += (pred[:, 0] == y).sum()
            acc[1] += (pred == y[:, None]).any(1).sum()
            acc[2] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-pkl", default="data/wlasl2000/train_kps27.pkl")
    ap.add_argument("--test-pkl", default="data/wlasl2000/test_kps27.pkl")
    ap.add_argument("--num-class", type=int, default=2000)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--output", default="output/slgcn_wlasl2000_joint")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    train_ds = PoseClips(args.train_pkl, args.frames, train=True)
    test_ds = PoseClips(args.test_pkl, args.frames, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=64,
                         num_workers=4, pin_memory=True)

    model = SLGCN(args.num_class).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = DDP(model, device_ids=[local_rank])
    base_lr = args.lr * args.batch_size * world / 256
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name.endswith(".A") else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=base_lr, momentum=0.9, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()

    out = Path(args.output)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "log.jsonl", "a")

    total = args.epochs * len(train_dl)
    step, best = 0, 0.0
    for epoch in range(args.epochs):
        ddp.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for x, y in train_dl:
            lr = cosine_lr(step, total, args.warmup * len(train_dl), base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ddp(x), y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter[0] += loss.detach().float()
            meter[1] += 1
            step += 1
        dist.all_reduce(meter)
        top1, top5 = run_eval(model, test_dl, device)
        if rank == 0:
            rec = {"epoch": epoch + 1, "lr": lr, "loss": (meter[0] / meter[1]).item(),
                   "top1": top1, "top5": top5, "sec": round(time.time() - t0, 1)}
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch + 1, "top1": top1}
            torch.save(ckpt, out / "last.pth")
            if top1 > best:
                best = top1
                torch.save(ckpt, out / "best.pth")

    if rank == 0:
        print(f"best per-instance top1 {best:.4f}")
        log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
