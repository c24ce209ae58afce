"""Isolated sign recognition from body+hand keypoints, signer-independent split.

annotations.csv columns: video_id, gloss, signer_id, split   (split in {train, val, test})
keypoints/<video_id>.npy : (T, 55, 3)  -- 13 body + 2 x 21 hand keypoints (x, y, score)
"""
import argparse
import json
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_BODY, N_HAND = 13, 21
V = N_BODY + 2 * N_HAND
BODY_EDGES = [(0, 1), (0, 2), (1, 3), (2, 4), (5, 6), (5, 7), (7, 9), (6, 8), (8, 10), (5, 11), (6, 12), (11, 12)]
HAND_EDGES = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 5), (5, 6), (6, 7), (7, 8), (0, 9), (9, 10), (10, 11),
              (11, 12), (0, 13), (13, 14), (14, 15), (15, 16), (0, 17), (17, 18), (18, 19), (19, 20)]
LH, RH = N_BODY, N_BODY + N_HAND


def graph():
    edges = list(BODY_EDGES)
    edges += [(LH + a, LH + b) for a, b in HAND_EDGES] + [(9, LH)]
    edges += [(RH + a, RH + b) for a, b in HAND_EDGES] + [(10, RH)]
    A = np.eye(V, dtype=np.float32)
    for i, j in edges:
        A[i, j] = A[j, i] = 1
    deg = A.sum(1)
    return A / np.sqrt(deg[:, None] * deg[None, :])


def build_vocab(df):
    glosses = list(set(df["gloss"].str.strip().str.lower()))
    return {g: i for i, g in enumerate(glosses)}


class KeypointSigns(Dataset):
    def __init__(self, df, kp_dir, vocab, frames=48, train=False):
        self.ids = df["video_id"].tolist()
        self.labels = [vocab[g.strip().lower()] for g in df["gloss"]]
        self.kp_dir = kp_dir
        self.frames = frames
        self.train = train

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        kp = np.load(os.path.join(self.kp_dir, f"{self.ids[i]}.npy")).astype(np.float32)
        t = kp.shape[0]
        if self.train:
            idx = np.sort(np.random.randint(0, t, self.frames))
        else:
            idx = np.linspace(0, t - 1, self.frames).astype(np.int64)
        kp = kp[idx]
        xy = kp[..., :2]
        centre = xy[:, [5, 6]].mean(1, keepdims=True)
        scale = np.linalg.norm(xy[:, 5] - xy[:, 6], axis=-1).mean() + 1e-3
        xy = (xy - centre) / scale
        if self.train:
            theta = np.random.uniform(-0.2, 0.2)
            rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]], dtype=np.float32)
            xy = xy @ rot.T
        x = np.concatenate([xy, kp[..., 2:]], -1)
        return torch.from_numpy(x.transpose(2, 0, 1).copy()), self.labels[i]


class GCNUnit(nn.Module):
    def __init__(self, cin, cout, A, stride=1, subsets=3):
        super().__init__()
        self.PA = nn.Parameter(torch.from_numpy(A).unsqueeze(0).repeat(subsets, 1, 1)
                               + 1e-6 * torch.randn(subsets, V, V))
        self.convs = nn.ModuleList([nn.Conv2d(cin, cout, 1) for _ in range(subsets)])
        self.bn = nn.BatchNorm2d(cout)
        self.tcn = nn.Sequential(nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.BatchNorm2d(cout))
        self.res = (nn.Identity() if cin == cout and stride == 1
                    else nn.Sequential(nn.Conv2d(cin, cout, 1, (stride, 1)), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = 0
        for k, conv in enumerate(self.convs):
            y = y + torch.einsum("nctv,vw->nctw", conv(x), self.PA[k])
        y = F.relu(self.bn(y))
        return F.relu(self.tcn(y) + self.res(x))


class SignGCN(nn.Module):
    def __init__(self, num_class, in_channels=3):
        super().__init__()
        A = graph()
        self.input_bn = nn.BatchNorm1d(in_channels * V)
        dims = [(in_channels, 64, 1), (64, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
        self.units = nn.ModuleList([GCNUnit(a, b, A, s) for a, b, s in dims])
        self.drop = nn.Dropout(0.4)
        self.cls = nn.Linear(256, num_class)

    def forward(self, x):
        n, c, t, v = x.shape
        x = self.input_bn(x.permute(0, 1, 3, 2).reshape(n, c * v, t)).reshape(n, c, v, t).permute(0, 1, 3, 2)
        for u in self.units:
            x = u(x)
        return self.cls(self.drop(x.mean((2, 3))))


@torch.no_grad()
def test_full(net, loader, device):
    net.eval()
    c1 = c5 = tot = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        top = net(x).topk(5, 1).indices
        c1 += (top[:, 0] == y).sum().item()
        c5 += (top == y[:, None]).any(1).sum().item()
        tot += len(y)
    return c1 / tot, c5 / tot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/signs")
    ap.add_argument("--out", default="checkpoints/signgcn_si")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--frames", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    df = pd.read_csv(os.path.join(args.root, "annotations.csv"))
    vocab = build_vocab(df[df["split"] == "train"])
    kp_dir = os.path.join(args.root, "keypoints")
    train_df = df[(df["split"] == "train")]
    val_df = df[(df["split"] == "val") & df["gloss"].str.strip().str.lower().isin(vocab)]
    train_ds = KeypointSigns(train_df, kp_dir, vocab, args.frames, train=True)
    val_ds = KeypointSigns(val_df, kp_dir, vocab, args.frames)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=8)

    model = SignGCN(len(vocab)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab.json"), "w") as f:
            json.dump(vocab, f, indent=1)
        print(f"{len(vocab)} glosses, {len(train_ds)} train / {len(val_ds)} val clips, {world} GPUs")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot_loss = time.time(), torch.zeros(1, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optim.step()
            sched.step()
            tot_loss += loss.detach()
        dist.all_reduce(tot_loss)
        tot_loss /= world * len(train_dl)

        if rank == 0:
            top1, top5 = test_full(model.module, val_dl, device)
            print(f"ep {epoch:03d} loss {tot_loss.item():.4f} val top1 {top1:.4f} top5 {top5:.4f} "
                  f"[{time.time() - t0:.0f}s]", flush=True)
            torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if top1 > best:
                best = top1
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
