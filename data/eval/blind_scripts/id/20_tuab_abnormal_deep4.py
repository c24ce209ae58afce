"""Normal vs. abnormal EEG classification on the TUH Abnormal corpus (TUAB v3).

Reading ~2700 EDF files with MNE is the slow part, so every rank reads only its
own share of the recordings (files[rank::world]) and keeps them in memory.
Recordings are cropped to the first 20 min, resampled to 100 Hz, clipped at
+-800 uV; training draws random 60-s crops, evaluation averages the
predictions over all non-overlapping crops of a recording.

    torchrun --nproc_per_node=8 20_tuab_abnormal_deep4.py --root /data/tuab/v3.0.0/edf
"""
import argparse
import glob
import os
import re
import time
from datetime import timedelta

import mne
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, RandomSampler

mne.set_log_level("ERROR")
SFREQ, CROP = 100, 6000


def channel_key(name):
    # "EEG FP1-REF" / "EEG FP1-LE" -> "FP1"
    m = re.match(r"EEG\s+([A-Z0-9]+)-", name.upper())
    return m.group(1) if m else None


def read_recording(path, max_minutes=20):
    raw = mne.io.read_raw_edf(path, preload=False)
    keys = {ch: channel_key(ch) for ch in raw.ch_names}
    raw.pick([ch for ch, k in keys.items() if k is not None and k not in ("EKG", "PHOTIC", "ROC", "LOC")])
    raw.crop(tmax=min(raw.times[-1], 60 * max_minutes)).load_data()
    raw.resample(SFREQ)
    data = np.clip(raw.get_data() * 1e6, -800, 800).astype(np.float32)
    return {channel_key(ch): data[i] for i, ch in enumerate(raw.ch_names)}


class RecordingCrops(Dataset):
    def __init__(self, recordings, labels, ch_order, random_crop=True):
        self.x = [np.stack([rec[c] for c in ch_order]) / 50.0 for rec in recordings]
        self.y = labels
        self.random_crop = random_crop
        self.crops = [(r, s) for r, x in enumerate(self.x) for s in range(0, x.shape[1] - CROP + 1, CROP)]

    def __len__(self):
        return len(self.x) if self.random_crop else len(self.crops)

    def __getitem__(self, i):
        if self.random_crop:
            x = self.x[i]
            s = np.random.randint(0, x.shape[1] - CROP + 1)
            return torch.from_numpy(x[:, s:s + CROP]), self.y[i], i
        r, s = self.crops[i]
        return torch.from_numpy(self.x[r][:, s:s + CROP]), self.y[r], r


class Deep4(nn.Module):
    def __init__(self, n_chans, n_classes=2, f=(25, 50, 100, 200), drop=0.5):
        super().__init__()
        self.first = nn.Sequential(
            nn.Conv2d(1, f[0], (1, 10)), nn.Conv2d(f[0], f[0], (n_chans, 1), bias=False),
            nn.BatchNorm2d(f[0]), nn.ELU(), nn.MaxPool2d((1, 3), (1, 3)),
        )
        blocks = []
        for a, b in zip(f[:-1], f[1:]):
            blocks += [nn.Dropout(drop), nn.Conv2d(a, b, (1, 10), bias=False), nn.BatchNorm2d(b), nn.ELU(),
                       nn.MaxPool2d((1, 3), (1, 3))]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(f[-1], n_classes))

    def forward(self, x):
        return self.head(self.blocks(self.first(x.unsqueeze(1))))


def load_split(root, split, rank, world):
    files = sorted(glob.glob(os.path.join(root, split, "*", "**", "*.edf"), recursive=True))
    mine = files[rank::world]
    recs = [read_recording(f) for f in mine]
    labels = [int("/abnormal/" in f) for f in mine]
    return recs, labels


@torch.no_grad()
def evaluate(model, ds, device):
    """Recording-level accuracy: mean softmax over crops, counts all-reduced."""
    model.eval()
    probs = torch.zeros(len(ds.x), 2, device=device)
    for x, _, r in DataLoader(ds, batch_size=64, shuffle=False):
        probs.index_add_(0, r.to(device), F.softmax(model(x.to(device)), 1))
    pred = probs.argmax(1)
    y = torch.tensor(ds.y, device=device)
    stats = torch.stack([(pred == y).sum(), torch.tensor(len(y), device=device)]).float()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/tuab/v3.0.0/edf")
    ap.add_argument("--epochs", type=int, default=35)
    ap.add_argument("--steps_per_epoch", type=int, default=300)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="ckpt/tuab_deep4")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # EDF loading takes a while and not equally long on every rank
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    t0 = time.time()
    train_recs, train_y = load_split(args.root, "train", rank, world)
    eval_recs, eval_y = load_split(args.root, "eval", rank, world)
    # montage: channels present in every recording
    ch_order = sorted(set.intersection(*[set(r) for r in train_recs + eval_recs]))
    print(f"[rank {rank}] {len(train_recs)} train / {len(eval_recs)} eval recordings, "
          f"{len(ch_order)} channels, loaded in {time.time() - t0:.0f}s", flush=True)

    train_ds = RecordingCrops(train_recs, train_y, ch_order, random_crop=True)
    eval_ds = RecordingCrops(eval_recs, eval_y, ch_order, random_crop=False)
    # the data is already sharded per rank; a fixed number of random crops per epoch
    # gives every rank the same number of steps
    sampler = RandomSampler(train_ds, replacement=True, num_samples=args.steps_per_epoch * args.bs)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                          drop_last=True, worker_init_fn=lambda w: np.random.seed(1000 * rank + w + int(time.time())))

    model = Deep4(n_chans=len(ch_order)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.steps_per_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        for x, y, _ in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = evaluate(model.module, eval_ds, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} eval recording acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "ch_order": ch_order, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
