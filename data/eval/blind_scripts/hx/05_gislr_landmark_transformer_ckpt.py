"""Isolated ASL sign recognition (Google "ASL Signs" / GISLR, 250 signs) from MediaPipe landmarks.

Deep pre-LN transformer over frames with activation checkpointing (long clips, big batches);
an auxiliary dominant-hand head is trained for the first --aux-epochs epochs only.
Validation = one fold of participants (participant-disjoint).

    torchrun --nproc_per_node=8 05_gislr_landmark_transformer_ckpt.py --data /data/gislr --fold 0
"""
import argparse
import json
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LIPS = [61, 185, 40, 39, 37, 0, 267, 269, 270, 409, 291, 146, 91, 181, 84, 17, 314, 405, 321, 375]
LHAND = list(range(468, 489))
POSE = list(range(489, 522))
RHAND = list(range(522, 543))
POINTS = LIPS + LHAND + RHAND + POSE[11:17]
MAX_LEN = 128
HAND_DIM = 42 * 2  # both hands, (x, y)


class SignLandmarks(Dataset):
    def __init__(self, df, npy_dir, sign2idx, train):
        self.paths = [os.path.join(npy_dir, f"{s}.npy") for s in df["sequence_id"]]
        self.labels = [sign2idx[s] for s in df["sign"]]
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        x = np.load(self.paths[i])[:, POINTS, :2].astype(np.float32)  # T, P, 2 (NaN when not detected)
        if self.train:
            t = len(x)
            if t > 8 and np.random.rand() < 0.5:
                new_t = max(4, int(t * np.random.uniform(0.7, 1.3)))
                x = x[np.linspace(0, t - 1, new_t).round().astype(int)]
            if np.random.rand() < 0.5:
                x[..., 0] = 1.0 - x[..., 0]
                n_l = len(LIPS)
                x = np.concatenate([x[:, :n_l], x[:, n_l + 21:n_l + 42], x[:, n_l:n_l + 21], x[:, n_l + 42:]], 1)
        x = x[:MAX_LEN]
        mean = np.nanmean(x, axis=(0, 1), keepdims=True)
        std = np.nanstd(x, axis=(0, 1), keepdims=True) + 1e-6
        x = np.nan_to_num((x - mean) / std)
        out = np.zeros((MAX_LEN, x.shape[1] * 2), np.float32)
        out[:len(x)] = x.reshape(len(x), -1)
        mask = np.zeros(MAX_LEN, bool)
        mask[:len(x)] = True
        return torch.from_numpy(out), torch.from_numpy(mask), self.labels[i]


class Block(nn.Module):
    def __init__(self, d, heads, drop):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=drop, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(drop), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LandmarkTransformer(nn.Module):
    def __init__(self, in_dim, num_classes, d=384, depth=12, heads=6, drop=0.1, grad_ckpt=True):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_dim, d), nn.LayerNorm(d), nn.GELU(), nn.Linear(d, d))
        self.pos = nn.Parameter(torch.randn(1, MAX_LEN, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads, drop) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, num_classes)
        self.hand_head = nn.Sequential(nn.Linear(HAND_DIM, 256), nn.GELU(), nn.Linear(256, num_classes))
        self.grad_ckpt = grad_ckpt

    def forward(self, x, mask, use_aux=False):
        h = self.embed(x) + self.pos
        pad = ~mask
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, pad)
            else:
                h = blk(h, pad)
        m = mask[..., None].float()
        pooled = (self.norm(h) * m).sum(1) / m.sum(1).clamp(min=1)
        logits = self.head(pooled)
        if not use_aux:
            return logits, None
        n_l = len(LIPS) * 2
        hands = (x[..., n_l:n_l + HAND_DIM] * m).sum(1) / m.sum(1).clamp(min=1)
        return logits, self.hand_head(hands)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/gislr")
    ap.add_argument("--fold", type=int, default=0)
    ap.add_argument("--n-folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--aux-epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--out", default="runs/gislr_tf")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    np.random.seed(42 + rank)

    df = pd.read_csv(os.path.join(args.data, "train.csv"))
    with open(os.path.join(args.data, "sign_to_prediction_index_map.json")) as f:
        sign2idx = json.load(f)
    participants = sorted(df["participant_id"].unique())
    val_participants = set(participants[args.fold::args.n_folds])
    train_df = df[~df["participant_id"].isin(val_participants)]
    val_df = df[df["participant_id"].isin(val_participants)]
    npy_dir = os.path.join(args.data, "npy")
    train_ds = SignLandmarks(train_df, npy_dir, sign2idx, train=True)
    val_ds = SignLandmarks(val_df, npy_dir, sign2idx, train=False)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 512, num_workers=4)

    model = LandmarkTransformer(len(POINTS) * 2, len(sign2idx)).to(device)
    # hand_head only receives gradients while use_aux is on
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world * args.batch_size / 1024, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / (2 * len(train_dl))) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        use_aux = epoch < args.aux_epochs
        for x, mask, y in train_dl:
            x, mask, y = x.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux = model(x, mask, use_aux=use_aux)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=0.2)
                if aux is not None:
                    loss = loss + 0.3 * F.cross_entropy(aux.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, mask, y in val_dl:
                logits, _ = model(x.to(device), mask.to(device))
                acc += torch.tensor([(logits.argmax(-1).cpu() == y).sum().item(), len(y)], device=device)
        dist.all_reduce(acc)
        val_acc = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val acc {val_acc:.4f}", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": val_acc},
                           os.path.join(args.out, f"fold{args.fold}_best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
