"""N-HiTS global model on the UCI electricity dataset (321 clients, hourly).

Windows are drawn from every series; each window is scaled by the mean absolute value of its own
lookback (per-series, per-window normalisation), as in the N-BEATS/N-HiTS papers.

    torchrun --nproc_per_node=4 16_nhits_electricity.py --csv data/electricity.csv
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

logger = logging.getLogger("nhits")


class SeriesWindows(Dataset):
    """All (series, t) windows of a (T, N) panel. Returns lookback, horizon, series id."""

    def __init__(self, panel, lookback, horizon, start, end, step=1):
        self.panel = torch.from_numpy(panel).float()
        self.L, self.H = lookback, horizon
        ts = np.arange(max(start, lookback), end - horizon + 1, step)
        ns = np.arange(panel.shape[1])
        self.index = np.stack(np.meshgrid(ns, ts, indexing="ij"), -1).reshape(-1, 2)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        n, t = self.index[i]
        x = self.panel[t - self.L:t, n]
        y = self.panel[t:t + self.H, n]
        return x, y, int(n)


class NHiTSBlock(nn.Module):
    def __init__(self, L, H, pool, n_coef, hidden=512, layers=2):
        super().__init__()
        self.pool = nn.MaxPool1d(pool, pool, ceil_mode=True)
        d_in = int(np.ceil(L / pool))
        mlp = [nn.Linear(d_in, hidden), nn.ReLU()]
        for _ in range(layers - 1):
            mlp += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.mlp = nn.Sequential(*mlp)
        self.back = nn.Linear(hidden, L)
        self.fore = nn.Linear(hidden, n_coef)
        self.H = H

    def forward(self, x):
        h = self.mlp(self.pool(x.unsqueeze(1)).squeeze(1))
        coef = self.fore(h).unsqueeze(1)
        fc = F.interpolate(coef, size=self.H, mode="linear", align_corners=False).squeeze(1)
        return self.back(h), fc


class NHiTS(nn.Module):
    def __init__(self, L, H, pools=(16, 8, 1), n_coefs=(2, 12, 48), blocks_per_stack=1, hidden=512):
        super().__init__()
        self.blocks = nn.ModuleList()
        for p, c in zip(pools, n_coefs):
            for _ in range(blocks_per_stack):
                self.blocks.append(NHiTSBlock(L, H, p, min(c, H), hidden))

    def forward(self, x):
        resid, forecast = x, 0.0
        for b in self.blocks:
            back, fc = b(resid)
            resid = resid - back
            forecast = forecast + fc
        return forecast


def scale(x):
    s = x.abs().mean(-1, keepdim=True).clamp(min=1e-3)
    return x / s, s


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    a = torch.zeros(3, device=device, dtype=torch.float64)  # |err|, |y|, count
    for x, y, _ in loader:
        x, y = x.to(device), y.to(device)
        xs, s = scale(x)
        pred = net(xs) * s
        a[0] += (pred - y).abs().sum()
        a[1] += y.abs().sum()
        a[2] += ((pred - y) ** 2).sum()
    dist.all_reduce(a)
    net.train()
    return (a[0] / a[1]).item(), a[2].item()  # ND (normalised deviation), SSE


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--lookback", type=int, default=5 * 168)
    ap.add_argument("--horizon", type=int, default=168)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--val-days", type=int, default=14)
    ap.add_argument("--test-days", type=int, default=14)
    ap.add_argument("--out", default="outputs/nhits_elec")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1)

    panel = pd.read_csv(args.csv, index_col=0, parse_dates=True).to_numpy(dtype=np.float32)
    T = panel.shape[0]
    t_test = T - args.test_days * 24
    t_val = t_test - args.val_days * 24
    train_ds = SeriesWindows(panel, args.lookback, args.horizon, 0, t_val)
    val_ds = SeriesWindows(panel, args.lookback, args.horizon, t_val, t_test, step=24)
    test_ds = SeriesWindows(panel, args.lookback, args.horizon, t_test - args.horizon, T, step=24)
    logger.info("windows: train %d val %d test %d", len(train_ds), len(val_ds), len(test_ds))

    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024, num_workers=2)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=1024, num_workers=2)

    net = NHiTS(args.lookback, args.horizon).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, args.epochs // 3), gamma=0.5)

    os.makedirs(args.out, exist_ok=True)
    best_nd = float("inf")
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for i, (x, y, _) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            xs, s = scale(x)
            pred = model(xs)
            loss = F.l1_loss(pred, y / s)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and i % 500 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, i, len(train_dl), loss.item())
        sched.step()
        dist.all_reduce(tot)
        val_nd, _ = evaluate(net, val_dl, device)
        logger.info("epoch %d | train %.4f | val ND %.4f | %.0fs", epoch, (tot[0] / tot[1]).item(), val_nd,
                    time.time() - t0)
        if val_nd < best_nd:
            best_nd = val_nd
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_nd": val_nd},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    ck = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    net.load_state_dict(ck["model"])
    test_nd, sse = evaluate(net, test_dl, device)
    n_test = len(test_ds) * args.horizon
    logger.info("best epoch %d | test ND %.4f RMSE %.3f", ck["epoch"], test_nd, (sse / n_test) ** 0.5)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
