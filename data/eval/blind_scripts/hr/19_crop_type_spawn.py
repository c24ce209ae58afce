"""Parcel-level crop-type classification from Sentinel-2 time series (PSE + temporal attention).

Each parcel is a set of pixels x T dates x 10 bands (S2Agri / PASTIS-style .npy per parcel).
Started with plain `python`; one process per visible GPU via torch.multiprocessing.

    python 19_crop_type_spawn.py --data /data/s2agri_parcels --gpus 4
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/s2agri_parcels")
    p.add_argument("--out", default="runs/pse_tae")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--n-pixels", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fold", type=int, default=1)
    return p.parse_args()


class ParcelSet(Dataset):
    """Samples a fixed number of pixels per parcel (with replacement for small parcels)."""

    def __init__(self, root, ids, n_pixels, stats, train):
        self.root, self.ids, self.n, self.train = root, ids, n_pixels, train
        with open(os.path.join(root, "labels.json")) as f:
            self.labels = json.load(f)
        with open(os.path.join(root, "dates.json")) as f:
            self.doy = torch.tensor(json.load(f), dtype=torch.float32)
        self.mean = np.asarray(stats["mean"], np.float32)
        self.std = np.asarray(stats["std"], np.float32)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        pid = self.ids[i]
        x = np.load(os.path.join(self.root, "DATA", f"{pid}.npy")).astype(np.float32)  # (T, C, S)
        s = x.shape[-1]
        if self.train:
            idx = np.random.choice(s, self.n, replace=s < self.n)
        else:
            idx = np.linspace(0, s - 1, self.n).astype(int)
        x = (x[..., idx] - self.mean[None, :, None]) / self.std[None, :, None]
        return torch.from_numpy(x), self.doy, self.labels[str(pid)], pid


class PSE(nn.Module):
    def __init__(self, c_in=10, dims=(32, 64), out=128):
        super().__init__()
        self.mlp1 = nn.Sequential(nn.Linear(c_in, dims[0]), nn.LayerNorm(dims[0]), nn.ReLU(),
                                  nn.Linear(dims[0], dims[1]), nn.LayerNorm(dims[1]), nn.ReLU())
        self.mlp2 = nn.Sequential(nn.Linear(2 * dims[1], out), nn.LayerNorm(out), nn.ReLU())

    def forward(self, x):  # (B, T, C, S)
        h = self.mlp1(x.transpose(2, 3))  # (B, T, S, D)
        return self.mlp2(torch.cat([h.mean(2), h.std(2)], -1))  # (B, T, out)


class TAE(nn.Module):
    def __init__(self, d=128, heads=4, n_classes=20):
        super().__init__()
        self.d = d
        self.attn = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True), 2)
        self.query = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pool = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, n_classes))

    def pos_enc(self, doy):
        i = torch.arange(self.d // 2, device=doy.device, dtype=torch.float32)
        freq = 1000 ** (-2 * i / self.d)
        ang = doy[..., None] * freq
        return torch.cat([ang.sin(), ang.cos()], -1)

    def forward(self, h, doy):
        h = self.attn(h + self.pos_enc(doy))
        q = self.query.expand(h.size(0), -1, -1)
        pooled, _ = self.pool(q, h, h)
        return self.head(pooled[:, 0])


class PSETAE(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.pse = PSE()
        self.tae = TAE(n_classes=n_classes)

    def forward(self, x, doy):
        return self.tae(self.pse(x), doy)


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    with open(os.path.join(args.data, "folds.json")) as f:
        folds = json.load(f)
    with open(os.path.join(args.data, "norm.json")) as f:
        stats = json.load(f)
    n_classes = folds["n_classes"]
    test_ids = folds[f"fold{args.fold}"]["test"]
    train_ids = folds[f"fold{args.fold}"]["train"]

    train_ds = ParcelSet(args.data, train_ids, args.n_pixels, stats, train=True)
    test_ds = ParcelSet(args.data, test_ids[rank::world_size], args.n_pixels, stats, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test_ds, batch_size=256, shuffle=False, num_workers=4)

    model = DDP(PSETAE(n_classes).to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, doy, y, _ in train_dl:
            x, doy, y = x.to(device, non_blocking=True), doy.to(device), y.to(device)
            loss = F.cross_entropy(model(x, doy), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        # per-parcel predictions; shard sizes differ so gather as python objects
        model.eval()
        local = []
        with torch.no_grad():
            for x, doy, y, pid in test_dl:
                pred = model.module(x.to(device), doy.to(device)).argmax(1).cpu().tolist()
                local += list(zip([int(p) for p in pid], pred, y.tolist()))
        gathered = [None] * world_size
        dist.all_gather_object(gathered, local)

        if rank == 0:
            rows = sorted(r for part in gathered for r in part)
            y_pred = [r[1] for r in rows]
            y_true = [r[2] for r in rows]
            mf1 = f1_score(y_true, y_pred, average="macro")
            oa = float(np.mean(np.array(y_true) == np.array(y_pred)))
            print(f"epoch {epoch:3d} loss {(run[0] / run[1]).item():.4f} OA {oa:.4f} mF1 {mf1:.4f} "
                  f"({len(rows)} parcels, {time.time() - t0:.0f}s)", flush=True)
            if mf1 > best:
                best = mf1
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "mf1": mf1},
                           os.path.join(args.out, f"fold{args.fold}_best.pth"))
                with open(os.path.join(args.out, f"fold{args.fold}_report.txt"), "w") as f:
                    f.write(classification_report(y_true, y_pred, digits=4))

    dist.destroy_process_group()


def main():
    args = get_args()
    random.seed(0)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
