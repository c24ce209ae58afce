"""Patch-transformer load forecasting, multi-GPU with automatic restarts.

    python 09_forecast_restart_spawn.py --csv /data/electricity/LD2011_2014.csv \
        --out /nfs/forecast/patchtst_96 --gpus 4 --max-restarts 5

Workers are started with torch.multiprocessing.start_processes. If any of them
crashes (we see the odd NCCL timeout on this cluster) the whole group is started
again and resumes from the last checkpoint.
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("forecast")


class Windows(Dataset):
    def __init__(self, values, ctx, horizon):
        self.v = torch.from_numpy(values.astype(np.float32))   # [T, C]
        self.ctx, self.h = ctx, horizon
        self.n_t = len(values) - ctx - horizon + 1

    def __len__(self):
        return self.n_t * self.v.size(1)

    def __getitem__(self, i):
        t, c = divmod(i, self.v.size(1))
        s = self.v[t:t + self.ctx + self.h, c]
        return s[:self.ctx], s[self.ctx:]


class PatchTST(nn.Module):
    def __init__(self, ctx, horizon, patch=16, stride=8, d=128, heads=8, layers=3, drop=0.2):
        super().__init__()
        self.patch, self.stride = patch, stride
        n_patch = (ctx - patch) // stride + 2
        self.embed = nn.Linear(patch, d)
        self.pos = nn.Parameter(torch.randn(1, n_patch, d) * 0.02)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, drop, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.head = nn.Sequential(nn.Flatten(1), nn.Dropout(drop), nn.Linear(n_patch * d, horizon))

    def forward(self, x):
        mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True) + 1e-5
        z = (x - mu) / sd
        z = torch.cat([z, z[:, -1:].expand(-1, self.stride)], 1)
        p = z.unfold(1, self.patch, self.stride)
        h = self.encoder(self.embed(p) + self.pos)
        return self.head(h) * sd + mu


def load_splits(path):
    df = pd.read_csv(path, sep=";", decimal=",", index_col=0, parse_dates=True)
    df = df.resample("1h").sum()
    df = df.loc[:, (df != 0).mean() > 0.9]
    v = df.values
    n = len(v)
    return v[: int(0.7 * n)], v[int(0.7 * n): int(0.8 * n)], v[int(0.8 * n):]


@torch.no_grad()
def evaluate(model, dl, device):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in dl:
        x, y = x.to(device), y.to(device)
        pred = model(x)
        s[0] += ((pred - y) ** 2).sum()
        s[1] += (pred - y).abs().sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def worker(rank, args, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    logging.basicConfig(filename=os.path.join(args.out, f"rank{rank}.log"), level=logging.INFO,
                        format="%(asctime)s %(message)s")

    tr, va, _ = load_splits(args.csv)
    mean, std = tr.mean(0), tr.std(0) + 1e-6
    tr, va = (tr - mean) / std, (va - mean) / std
    train_ds, val_ds = Windows(tr, args.ctx, args.horizon), Windows(va, args.ctx, args.horizon)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)
    vdl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                     batch_size=1024, num_workers=2)

    model = PatchTST(args.ctx, args.horizon).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = len(dl)
    total = args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    ckpt = os.path.join(args.out, "ckpt.pt")
    start_epoch, best = 0, float("inf")
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch, best = st["epoch"] + 1, st["best"]
        log.info("restart %s: resuming at epoch %d", os.environ.get("RESTART", "0"), start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(tot)
        mse, mae = evaluate(model, vdl, device)
        best = min(best, mse)
        log.info("epoch %d train_mse %.4f val_mse %.4f val_mae %.4f best %.4f (%.0fs)",
                 epoch, (tot[0] / tot[1]).item(), mse, mae, best, time.time() - t0)
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--ctx", type=int, default=336)
    ap.add_argument("--horizon", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--port", type=int, default=29560)
    ap.add_argument("--max-restarts", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s")

    for attempt in range(args.max_restarts + 1):
        os.environ["MASTER_PORT"] = str(args.port + attempt)
        os.environ["RESTART"] = str(attempt)
        ctx = mp.start_processes(worker, args=(args, args.gpus), nprocs=args.gpus,
                                 join=False, start_method="spawn")
        try:
            while not ctx.join():
                pass
            log.info("training finished")
            return
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            log.warning("attempt %d failed: %s", attempt, str(e).splitlines()[0])
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                p.join()
    raise SystemExit(f"failed after {args.max_restarts} restarts")


if __name__ == "__main__":
    main()
