"""Water-treatment plant anomaly detection (SWaT-like, 51 sensors/actuators).

Preprocessing (resample, clip, per-sensor robust scaling, window index) is slow
on the raw historian export, so it is cached to <cache_dir>/prep_<hash>.npz.

torchrun --standalone --nproc_per_node=4 09_water_plant_cached_ad.py \
    --raw /datasets/wtp/historian --cache-dir /datasets/wtp/cache
"""
import argparse
import glob
import hashlib
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", default="runs/wtp_ad")
    ap.add_argument("--freq", default="10s")
    ap.add_argument("--win", type=int, default=100)
    ap.add_argument("--hop", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--anomaly-ratio", type=float, default=1.0, help="percent, for threshold")
    return ap.parse_args()


def cache_key(args):
    files = sorted(glob.glob(os.path.join(args.raw, "*.csv")))
    h = hashlib.md5(json.dumps([files, args.freq, args.win, args.hop]).encode()).hexdigest()[:10]
    return os.path.join(args.cache_dir, f"prep_{h}.npz")


def preprocess(args):
    frames = []
    for f in sorted(glob.glob(os.path.join(args.raw, "*.csv"))):
        df = pd.read_csv(f, parse_dates=["Timestamp"]).set_index("Timestamp")
        frames.append(df)
    df = pd.concat(frames).sort_index()
    labels = (df.pop("Normal/Attack").str.strip() == "Attack").astype(np.int8)
    df = df.resample(args.freq).mean().ffill()
    labels = labels.resample(args.freq).max().fillna(0).astype(np.int8)
    x = df.to_numpy(np.float32)
    n = len(x)
    tr_end, va_end = int(0.6 * n), int(0.8 * n)
    med = np.median(x[:tr_end], axis=0)
    iqr = np.subtract(*np.percentile(x[:tr_end], [75, 25], axis=0)) + 1e-3
    x = np.clip((x - med) / iqr, -10, 10).astype(np.float32)
    return dict(x=x, y=labels.to_numpy(), tr_end=tr_end, va_end=va_end, med=med, iqr=iqr,
                columns=np.array(df.columns))


def load_or_build(args):
    path = cache_key(args)
    if not os.path.exists(path):
        os.makedirs(args.cache_dir, exist_ok=True)
        data = preprocess(args)
        np.savez(path, **data)
    z = np.load(path, allow_pickle=True)
    return {k: z[k] for k in z.files}


class Win(Dataset):
    def __init__(self, x, y, lo, hi, win, hop):
        self.x, self.y, self.win = x, y, win
        self.starts = np.arange(lo, hi - win + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return (torch.from_numpy(self.x[s:s + self.win]),
                torch.tensor(int(self.y[s:s + self.win].max())), i)


class TransformerAE(nn.Module):
    def __init__(self, n_feat, win, hidden, layers):
        super().__init__()
        self.inp = nn.Linear(n_feat, hidden)
        self.pos = nn.Parameter(torch.zeros(1, win, hidden))
        enc = nn.TransformerEncoderLayer(hidden, 8, 4 * hidden, 0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(enc, layers)
        self.bottleneck = nn.Linear(hidden, hidden // 4)
        self.expand = nn.Linear(hidden // 4, hidden)
        self.out = nn.Linear(hidden, n_feat)

    def forward(self, x):
        h = self.enc(self.inp(x) + self.pos)
        h = self.expand(torch.tanh(self.bottleneck(h)))
        return self.out(h)


@torch.no_grad()
def window_scores(model, ds, device, rank, world, batch):
    """Scores for every window of ds, gathered on all ranks in dataset order."""
    sampler = DistributedSampler(ds, shuffle=False)
    dl = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=4)
    model.eval()
    idx, sc, lab = [], [], []
    for x, y, i in dl:
        x = x.to(device)
        sc.append((model(x) - x).pow(2).mean((1, 2)))
        lab.append(y.to(device))
        idx.append(i.to(device))
    model.train()
    local = torch.stack([torch.cat(idx).float(), torch.cat(sc), torch.cat(lab).float()], 1)
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local)  # DistributedSampler gives every rank the same count
    allv = torch.cat(out).cpu().numpy()
    order = np.argsort(allv[:, 0], kind="stable")
    allv = allv[order]
    keep = np.r_[True, np.diff(allv[:, 0]) > 0]
    allv = allv[keep]
    return allv[:, 1], allv[:, 2].astype(int)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    d = load_or_build(args)
    x, y = d["x"], d["y"]
    tr_end, va_end = int(d["tr_end"]), int(d["va_end"])
    train_ds = Win(x, y, 0, tr_end, args.win, args.hop)
    val_ds = Win(x, y, tr_end, va_end, args.win, args.win)
    test_ds = Win(x, y, va_end, len(x), args.win, args.win)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)
    model = DDP(TransformerAE(x.shape[1], args.win, args.hidden, args.layers).to(device),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"features={x.shape[1]} train={len(train_ds)} val={len(val_ds)} test={len(test_ds)}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for xb, _, _ in dl:
            xb = xb.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(xb), xb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot[0] += loss.detach()
            tot[1] += 1
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.5f} {time.time() - t0:.0f}s",
                  flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "ae.pt"))

    # threshold: top anomaly_ratio % of validation scores are flagged
    val_s, _ = window_scores(model, val_ds, device, rank, world, 512)
    thr = np.percentile(val_s, 100 - args.anomaly_ratio)
    test_s, test_y = window_scores(model, test_ds, device, rank, world, 512)
    if rank == 0:
        pred = (test_s > thr).astype(int)
        print(f"threshold {thr:.4f}  test F1 {f1_score(test_y, pred):.3f}  "
              f"AUROC {roc_auc_score(test_y, test_s):.3f}")
        with open(os.path.join(args.out, "threshold.json"), "w") as f:
            json.dump({"threshold": float(thr), "anomaly_ratio": args.anomaly_ratio}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
