"""Tremor detection in Parkinson's disease from smartwatch accelerometry
(MJFF Levodopa Response Study, GENEActiv wrist sensor, 50 Hz).

Each clinician-rated task segment (tremor score 0-4) was exported by export_levodopa.py as
    {data_dir}/{subject}/{visit}_{task}_{trial}.npy   float32 [3, T]
    {data_dir}/labels.csv                             subject, file, tremor
Segments are cut into 10 s windows (hop 2.5 s); tremor present = score >= 1.
Subject-wise 4-fold CV; --fold selects the held-out subjects.

Launch (one process per GPU, spawned from here):
    python 20_pd_tremor_smartwatch.py --data_dir /data/levodopa_geneactiv --fold 0
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FS = 50


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out_dir", default="runs/pd_tremor")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--n_folds", type=int, default=4)
    p.add_argument("--win_s", type=float, default=10.0)
    p.add_argument("--hop_s", type=float, default=2.5)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--seed", type=int, default=31)
    return p.parse_args()


class TremorWindows(Dataset):
    def __init__(self, data_dir, rows, win, hop, train=False):
        self.segments, self.index, self.labels = [], [], []
        for k, r in enumerate(rows.itertuples()):
            x = np.load(os.path.join(data_dir, r.subject, r.file)).astype(np.float32)
            x = x - x.mean(axis=1, keepdims=True)  # remove gravity / orientation offset
            self.segments.append(x)
            for s in range(0, x.shape[1] - win + 1, hop):
                self.index.append((k, s))
                self.labels.append(int(r.tremor >= 1))
        self.win, self.train = win, train

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        k, s = self.index[i]
        x = self.segments[k][:, s:s + self.win]
        if self.train:
            x = x[np.random.permutation(3)] * np.random.choice([-1.0, 1.0], size=(3, 1))  # axis swap / flip
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), self.labels[i]


class TremorNet(nn.Module):
    """Conv front-end + spectral branch (FFT magnitude 3-12 Hz, where rest tremor lives)."""

    def __init__(self, win):
        super().__init__()
        self.temporal = nn.Sequential(
            nn.Conv1d(3, 32, 9, padding=4), nn.BatchNorm1d(32), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(32, 64, 9, padding=4), nn.BatchNorm1d(64), nn.ReLU(), nn.MaxPool1d(2),
            nn.Conv1d(64, 128, 9, padding=4), nn.BatchNorm1d(128), nn.ReLU(), nn.AdaptiveMaxPool1d(1),
            nn.Flatten(),
        )
        freqs = np.fft.rfftfreq(win, 1 / FS)
        self.band = (int(np.searchsorted(freqs, 3.0)), int(np.searchsorted(freqs, 12.0)))
        n_bins = self.band[1] - self.band[0]
        self.spectral = nn.Sequential(nn.Linear(3 * n_bins, 128), nn.ReLU(), nn.Dropout(0.3))
        self.head = nn.Linear(256, 1)

    def forward(self, x):
        spec = torch.fft.rfft(x, dim=-1).abs()[..., self.band[0]:self.band[1]]
        spec = torch.log1p(spec).flatten(1)
        return self.head(torch.cat([self.temporal(x), self.spectral(spec)], 1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, n, device, world_size):
    model.eval()
    ps, ys = [], []
    for x, y in loader:
        ps.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
        ys.append(y.to(device, non_blocking=True))
    ps, ys = torch.cat(ps), torch.cat(ys)
    gp = [torch.zeros_like(ps) for _ in range(world_size)]
    gy = [torch.zeros_like(ys) for _ in range(world_size)]
    dist.all_gather(gp, ps)
    dist.all_gather(gy, ys)
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    return {"auroc": float(roc_auc_score(y, p)), "f1": float(f1_score(y, p > 0.5))}


def train(args, rank, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    labels = pd.read_csv(os.path.join(args.data_dir, "labels.csv"))
    subjects = np.array(sorted(labels["subject"].unique()))
    folds = np.array_split(np.random.RandomState(args.seed).permutation(subjects), args.n_folds)
    test_s, val_s = set(folds[args.fold]), set(folds[(args.fold + 1) % args.n_folds])
    split = labels["subject"].map(lambda s: "test" if s in test_s else "val" if s in val_s else "train")

    win, hop = int(args.win_s * FS), int(args.hop_s * FS)
    train_ds = TremorWindows(args.data_dir, labels[split == "train"], win, hop, train=True)
    val_ds = TremorWindows(args.data_dir, labels[split == "val"], win, win)
    test_ds = TremorWindows(args.data_dir, labels[split == "test"], win, win)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, 512, sampler=DistributedSampler(val_ds, world_size, rank, shuffle=False),
                        num_workers=2)
    test_dl = DataLoader(test_ds, 512, sampler=DistributedSampler(test_ds, world_size, rank, shuffle=False),
                         num_workers=2)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(TremorNet(win)).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    pos = float(np.mean(train_ds.labels))
    pos_weight = torch.tensor((1 - pos) / pos, device=device)

    ckpt = os.path.join(args.out_dir, f"tremornet_fold{args.fold}.pt")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"fold {args.fold}: {len(train_ds)} train windows ({pos:.1%} tremor), {len(val_ds)} val, "
              f"{len(test_ds)} test", flush=True)
    best, stale = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.float().to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(x), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(run)
        val = evaluate(model, val_dl, len(val_ds), device, world_size)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(run[0] / run[1]).item():.4f} val AUROC {val['auroc']:.4f} "
                  f"F1 {val['f1']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if val["auroc"] > best:
            best, stale = val["auroc"], 0
            if rank == 0:
                torch.save(model.module.state_dict(), ckpt)
        else:
            stale += 1
            if stale >= args.patience:
                break

    dist.barrier()
    model.module.load_state_dict(torch.load(ckpt, map_location=device))
    test = evaluate(model, test_dl, len(test_ds), device, world_size)
    if rank == 0:
        print(f"fold {args.fold} TEST AUROC {test['auroc']:.4f} F1 {test['f1']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    world_size = torch.cuda.device_count()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    mp.spawn(train, args=(args, world_size), nprocs=world_size, join=True)
