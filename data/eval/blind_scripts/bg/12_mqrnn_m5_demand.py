"""MQ-RNN (Wen et al. 2017): LSTM encoder + forking MLP decoders, quantile loss, on M5 item sales.

    torchrun --nproc_per_node=4 12_mqrnn_m5_demand.py --m5-dir data/m5 --level store_dept
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

H = 28


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--m5-dir", default="data/m5")
    p.add_argument("--level", choices=["item", "store_dept"], default="store_dept")
    p.add_argument("--out", default="runs/mqrnn_m5")
    p.add_argument("--context", type=int, default=365)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ctx-dim", type=int, default=32)
    p.add_argument("--quantiles", type=float, nargs="+", default=[0.05, 0.25, 0.5, 0.75, 0.95])
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--samples-per-series", type=int, default=20)
    return p.parse_args()


class MQRNN(nn.Module):
    def __init__(self, n_hist, n_fut, hidden, ctx_dim, quantiles, horizon=H):
        super().__init__()
        self.quantiles = list(quantiles)
        self.horizon = horizon
        self.encoder = nn.LSTM(n_hist, hidden, num_layers=2, batch_first=True, dropout=0.1)
        d_fut = n_fut * horizon
        # global decoder: one horizon-agnostic context per step plus a horizon-specific one
        self.global_mlp = nn.Sequential(nn.Linear(hidden + d_fut, 4 * ctx_dim), nn.ReLU(),
                                        nn.Linear(4 * ctx_dim, ctx_dim * (horizon + 1)))
        self.local_mlp = nn.Sequential(nn.Linear(2 * ctx_dim + n_fut, ctx_dim), nn.ReLU(),
                                       nn.Linear(ctx_dim, len(self.quantiles)))
        self.ctx_dim = ctx_dim

    def forward(self, hist, fut):
        # hist (B, T, n_hist), fut (B, H, n_fut)
        _, (h, _) = self.encoder(hist)
        b = hist.shape[0]
        ctx = self.global_mlp(torch.cat([h[-1], fut.flatten(1)], dim=1)).view(b, self.horizon + 1, self.ctx_dim)
        c_a = ctx[:, :1].expand(-1, self.horizon, -1)
        c_h = ctx[:, 1:]
        return self.local_mlp(torch.cat([c_a, c_h, fut], dim=-1))  # (B, H, Q)


def quantile_loss(pred, y, quantiles):
    q = torch.as_tensor(quantiles, device=pred.device).view(1, 1, -1)
    e = y.unsqueeze(-1) - pred
    return torch.max(q * e, (q - 1) * e).mean()


def load_m5(m5_dir, level):
    sales = pd.read_csv(os.path.join(m5_dir, "sales_train_evaluation.csv"))
    cal = pd.read_csv(os.path.join(m5_dir, "calendar.csv"))
    d_cols = [c for c in sales.columns if c.startswith("d_")]
    if level == "store_dept":
        sales = sales.groupby(["store_id", "dept_id"], as_index=False)[d_cols].sum()
        names = (sales["store_id"] + "_" + sales["dept_id"]).tolist()
    else:
        names = sales["id"].tolist()
    y = sales[d_cols].to_numpy(np.float32)  # (N, T)
    cal = cal.iloc[:len(d_cols) + H]
    cal_feats = np.stack([
        cal["wday"].to_numpy() / 7.0,
        cal["month"].to_numpy() / 12.0,
        cal["event_name_1"].notna().to_numpy(),
        cal[["snap_CA", "snap_TX", "snap_WI"]].max(axis=1).to_numpy(),
    ], 1).astype(np.float32)
    return y, cal_feats, names


class DemandWindows(Dataset):
    def __init__(self, y, cal, context, forecast_starts):
        self.y, self.cal, self.context = y, cal, context
        self.items = [(i, int(t)) for i in range(len(y)) for t in forecast_starts[i]]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        i, t = self.items[k]
        hist_y = self.y[i, t - self.context:t]
        scale = hist_y[-56:].mean() + 1.0
        hist = np.concatenate([(hist_y / scale)[:, None], self.cal[t - self.context:t]], 1)
        fut = self.cal[t:t + H]
        target = self.y[i, t:t + H] / scale
        return (torch.from_numpy(hist.astype(np.float32)), torch.from_numpy(fut),
                torch.from_numpy(target.astype(np.float32)), torch.tensor(scale, dtype=torch.float32))


@torch.no_grad()
def validate(net, loader, device, quantiles):
    net.eval()
    mid = quantiles.index(0.5)
    s = torch.zeros(4, device=device)
    for hist, fut, y, scale in loader:
        hist, fut, y, scale = hist.to(device), fut.to(device), y.to(device), scale.to(device)
        pred = net(hist, fut)
        s[0] += quantile_loss(pred, y, quantiles) * len(y)
        s[1] += len(y)
        s[2] += ((pred[..., mid] - y).abs() * scale[:, None]).sum()
        s[3] += (y * scale[:, None]).abs().sum()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[1]).item(), (s[2] / s[3]).item()


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    y, cal, names = load_m5(args.m5_dir, args.level)
    T = y.shape[1]
    val_start = T - H
    rng = np.random.default_rng(0)  # same draws on every rank
    lo = args.context
    train_starts = [rng.integers(lo, val_start - H + 1, size=args.samples_per_series) for _ in range(len(y))]
    train_ds = DemandWindows(y, cal, args.context, train_starts)
    val_ds = DemandWindows(y, cal, args.context, [[val_start]] * len(y))

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256, num_workers=2)

    torch.manual_seed(0)
    net = MQRNN(1 + cal.shape[1], cal.shape[1], args.hidden, args.ctx_dim, args.quantiles).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world ** 0.5)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.3, patience=1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(names)} series, {len(train_ds)} windows, {len(loader)} steps/epoch/rank", flush=True)
    best, wait, history = float("inf"), 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for hist, fut, target, _ in loader:
            hist = hist.to(device, non_blocking=True)
            fut = fut.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            loss = quantile_loss(model(hist, fut), target, model.quantiles)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        val_ql, val_wape = validate(net, val_loader, device, args.quantiles)
        sched.step(val_ql)
        history.append({"epoch": epoch, "val_quantile_loss": val_ql, "val_wape": val_wape,
                        "lr": opt.param_groups[0]["lr"], "seconds": time.time() - t0})
        if rank == 0:
            print(f"epoch {epoch} val QL {val_ql:.4f} WAPE {val_wape:.4f}", flush=True)
            pd.DataFrame(history).to_csv(os.path.join(args.out, "history.csv"), index=False)
        if val_ql < best:
            best, wait = val_ql, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "quantiles": args.quantiles, "names": names},
                           os.path.join(args.out, "best.pt"))
        else:
            wait += 1
            if wait > args.patience:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
