"""Signer-independent isolated sign recognition from MediaPipe Holistic keypoints.

Keypoints are pre-extracted to one .npy per video ((T, 543, 3): face, pose, left hand, right hand);
we keep pose upper body + both hands + a few face points. Validation is on held-out signers.

    torchrun --standalone --nproc_per_node=4 03_signer_independent_pose_transformer.py \
        --meta /data/signs/meta.csv --kp-dir /data/signs/holistic
"""
import argparse
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FACE_IDX = [0, 4, 13, 14, 33, 61, 133, 263, 291, 362]
POSE_IDX = [468 + i for i in range(0, 25)]
LHAND_IDX = list(range(501, 522))
RHAND_IDX = list(range(522, 543))
KEEP = FACE_IDX + POSE_IDX + LHAND_IDX + RHAND_IDX
# horizontal flip swaps the two hands (positions in KEEP)
HFLIP_PERM = np.r_[np.arange(35), np.arange(56, 77), np.arange(35, 56)]


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_signer_split(meta, num_val_signers):
    signers = sorted(meta["signer_id"].unique().tolist())
    val_signers = set(random.sample(signers, num_val_signers))
    train_df = meta[~meta["signer_id"].isin(val_signers)].reset_index(drop=True)
    val_df = meta[meta["signer_id"].isin(val_signers)].reset_index(drop=True)
    return train_df, val_df, sorted(val_signers)


class KeypointClips(Dataset):
    def __init__(self, df, kp_dir, label_map, max_len=96, train=True):
        self.df = df
        self.kp_dir = kp_dir
        self.label_map = label_map
        self.max_len = max_len
        self.train = train

    def __len__(self):
        return len(self.df)

    def _resample(self, kp):
        t = kp.shape[0]
        if self.train:
            # random speed change then random crop / pad
            speed = np.random.uniform(0.75, 1.25)
            new_t = max(4, int(round(t * speed)))
            kp = kp[np.linspace(0, t - 1, new_t).round().astype(int)]
            t = new_t
        if t > self.max_len:
            start = np.random.randint(0, t - self.max_len + 1) if self.train else (t - self.max_len) // 2
            kp = kp[start:start + self.max_len]
        return kp

    def __getitem__(self, i):
        row = self.df.iloc[i]
        kp = np.load(os.path.join(self.kp_dir, row["video_id"] + ".npy")).astype(np.float32)[:, KEEP, :2]
        kp = np.nan_to_num(kp, nan=0.0)
        kp = self._resample(kp)
        # normalise by shoulder centre / shoulder width, per frame
        ls, rs = kp[:, 10 + 11], kp[:, 10 + 12]
        centre = (ls + rs) / 2
        width = np.linalg.norm(ls - rs, axis=-1, keepdims=True).clip(1e-3)
        kp = (kp - centre[:, None]) / width[:, None]
        if self.train and np.random.rand() < 0.5:
            kp[..., 0] *= -1
            kp = kp[:, HFLIP_PERM]
        x = torch.zeros(self.max_len, len(KEEP) * 2)
        mask = torch.zeros(self.max_len, dtype=torch.bool)
        x[:len(kp)] = torch.from_numpy(kp.reshape(len(kp), -1))
        mask[:len(kp)] = True
        return x, mask, self.label_map[row["gloss"]]


class PoseTransformer(nn.Module):
    def __init__(self, in_dim, num_classes, d_model=256, depth=6, heads=8, max_len=96, drop=0.2):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_dim, d_model), nn.LayerNorm(d_model), nn.GELU(),
                                   nn.Linear(d_model, d_model))
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.zeros(1, max_len + 1, d_model))
        nn.init.trunc_normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, drop, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Sequential(nn.Dropout(drop), nn.Linear(d_model, num_classes))

    def forward(self, x, mask):
        b = x.shape[0]
        h = torch.cat([self.cls.expand(b, -1, -1), self.embed(x)], dim=1) + self.pos[:, :x.shape[1] + 1]
        pad = torch.cat([mask.new_zeros(b, 1), ~mask], dim=1)
        h = self.encoder(h, src_key_padding_mask=pad)
        return self.head(self.norm(h[:, 0]))


def cosine_with_warmup(step, total, warmup):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, mask, y in loader:
        x, mask, y = x.to(device), mask.to(device), y.to(device)
        acc[0] += (model(x, mask).argmax(-1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meta", required=True, help="csv with video_id, signer_id, gloss")
    ap.add_argument("--kp-dir", required=True)
    ap.add_argument("--num-val-signers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", default="runs/si_pose_tf")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    # different augmentation stream on every GPU
    seed_everything(args.seed + rank)

    meta = pd.read_csv(args.meta)
    label_map = {g: i for i, g in enumerate(sorted(meta["gloss"].unique()))}
    train_df, val_df, val_signers = make_signer_split(meta, args.num_val_signers)
    if rank == 0:
        print(f"val signers: {val_signers}; {len(train_df)} train / {len(val_df)} val videos")

    train_ds = KeypointClips(train_df, args.kp_dir, label_map, train=True)
    val_ds = KeypointClips(val_df, args.kp_dir, label_map, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=128, num_workers=4)

    model = PoseTransformer(len(KEEP) * 2, len(label_map)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, total, 5 * len(train_dl)))

    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for x, mask, y in train_dl:
            x, mask, y = x.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            loss = F.cross_entropy(model(x, mask), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(loss_sum)
        acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f} val-signer acc {acc * 100:.2f}")
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "label_map": label_map,
                            "val_signers": val_signers, "epoch": epoch}, os.path.join(args.out, "best.pt"))
    if rank == 0:
        print(f"best {best * 100:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
