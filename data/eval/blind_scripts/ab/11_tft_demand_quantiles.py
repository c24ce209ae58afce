"""Store-level demand forecasting: transformer encoder with a point head and a
quantile head (P10/P50/P90).  DDP with early stopping on validation pinball loss.

    torchrun --nnodes=1 --nproc_per_node=8 --max-restarts=3 11_tft_demand_quantiles.py \
        --data /mnt/fsx/demand/panel.parquet --out /mnt/fsx/demand/runs/tft_q
"""
import argparse
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

QUANTILES = (0.1, 0.5, 0.9)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=112)
    p.add_argument("--horizon", type=int, default=28)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--min-delta", type=float, default=1e-4)
    p.add_argument("--val-cutoff", default="2024-01-01")
    return p.parse_args()


class Windows(Dataset):
    """Sliding windows over per-series arrays; split is by time, not by random draw."""

    def __init__(self, series, cov, context, horizon, stride):
        self.series, self.cov = series, cov
        self.context, self.horizon = context, horizon
        self.index = []
        for sid, y in enumerate(series):
            for start in range(0, len(y) - context - horizon + 1, stride):
                self.index.append((sid, start))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        sid, s = self.index[i]
        y = self.series[sid]
        c = self.cov[sid]
        e = s + self.context
        scale = max(y[s:e].mean(), 1.0)
        past = np.stack([y[s:e] / scale, *c[:, s:e]], 0).T.astype(np.float32)
        fut_cov = c[:, e:e + self.horizon].T.astype(np.float32)
        target = (y[e:e + self.horizon] / scale).astype(np.float32)
        return torch.from_numpy(past), torch.from_numpy(fut_cov), torch.from_numpy(target), np.float32(scale)


def load_panel(path, cutoff, context, horizon):
    df = pd.read_parquet(path).sort_values(["store_item", "date"])
    cov_cols = ["price_idx", "promo", "dow_sin", "dow_cos", "holiday"]
    train_s, train_c, val_s, val_c = [], [], [], []
    cut = pd.Timestamp(cutoff)
    for _, g in df.groupby("store_item", sort=True):
        y = g["units"].to_numpy(np.float32)
        c = g[cov_cols].to_numpy(np.float32).T
        k = int((g["date"] < cut).sum())
        train_s.append(y[:k]); train_c.append(c[:, :k])
        val_s.append(y[k - context:k + horizon]); val_c.append(c[:, k - context:k + horizon])
    return (train_s, train_c), (val_s, val_c), len(cov_cols)


class DemandModel(nn.Module):
    def __init__(self, n_cov, d, layers, horizon):
        super().__init__()
        self.inp = nn.Linear(1 + n_cov, d)
        self.fut = nn.Linear(n_cov, d)
        self.pos = nn.Parameter(torch.zeros(1, 512, d))
        enc = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, layers)
        self.point = nn.Linear(d, 1)
        self.quant = nn.Linear(d, len(QUANTILES))
        self.horizon = horizon

    def forward(self, past, fut_cov):
        x = torch.cat([self.inp(past), self.fut(fut_cov)], 1)
        x = self.encoder(x + self.pos[:, : x.size(1)])
        h = x[:, -self.horizon:]
        return self.point(h).squeeze(-1), self.quant(h)


def pinball(pred_q, y):
    q = torch.tensor(QUANTILES, device=y.device)
    diff = y.unsqueeze(-1) - pred_q
    return torch.maximum(q * diff, (q - 1) * diff).mean()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)
    for past, fut, y, scale in loader:
        past, fut, y = past.to(device), fut.to(device), y.to(device)
        point, q = model.module(past, fut)
        acc[0] += pinball(q, y) * y.size(0)
        acc[1] += (point - y).abs().mean(1).sum()
        acc[2] += y.size(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out, exist_ok=True)

    (ts, tc), (vs, vc), n_cov = load_panel(args.data, args.val_cutoff, args.context, args.horizon)
    train_ds = Windows(ts, tc, args.context, args.horizon, stride=7)
    val_ds = Windows(vs, vc, args.context, args.horizon, stride=args.horizon)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1024, num_workers=4)

    model = DemandModel(n_cov, args.d_model, args.layers, args.horizon).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    state_path = os.path.join(args.out, "state.pt")
    start_epoch, best, bad = 0, float("inf"), 0
    if os.path.exists(state_path):
        st = torch.load(state_path, map_location=device)
        model.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        start_epoch, best, bad = st["epoch"] + 1, st["best"], st["bad"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for past, fut, y, _ in train_dl:
            past, fut, y = past.to(device, non_blocking=True), fut.to(device, non_blocking=True), \
                y.to(device, non_blocking=True)
            point, q = model(past, fut)
            loss = nn.functional.huber_loss(point, y, delta=1.0) + pinball(q, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.tensor(1.0, device=device)])
        dist.all_reduce(run)

        val_pinball, val_mae = validate(model, val_dl, device)
        should_stop = False
        if rank == 0:
            improved = val_pinball < best - args.min_delta
            if improved:
                best, bad = val_pinball, 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
            else:
                bad += 1
            should_stop = bad >= args.patience
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best, "bad": bad},
                       state_path)
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": (run[0] / run[1]).item(),
                                    "val_pinball": val_pinball, "val_mae": val_mae,
                                    "best": best, "secs": time.time() - t0}) + "\n")
            print(f"epoch {epoch} pinball {val_pinball:.5f} mae {val_mae:.4f} best {best:.5f} "
                  f"bad {bad}/{args.patience}", flush=True)

        stop = torch.tensor([1 if should_stop else 0])
        dist.broadcast(stop, src=0)
        if stop.item() == 1:
            if rank == 0:
                print(f"early stop at epoch {epoch}", flush=True)
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
