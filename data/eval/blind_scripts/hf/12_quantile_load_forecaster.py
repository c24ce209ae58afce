"""Quantile forecaster for daily traded volume (per stock), used to size VWAP
schedules. Encoder-decoder LSTM with static covariates (sector, cap bucket) and
known-future inputs (calendar, index-rebalance and option-expiry flags).

    torchrun --nproc_per_node=4 12_quantile_load_forecaster.py --panel /data/volume_panel.parquet
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("volq")

PAST_COLS = ["log_vol", "ret", "abs_ret", "hl_range", "log_turnover"]
FUTURE_COLS = ["dow_sin", "dow_cos", "is_expiry", "is_rebalance", "is_month_end", "is_half_day"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--panel", required=True)
    p.add_argument("--encoder-len", type=int, default=60)
    p.add_argument("--decoder-len", type=int, default=5)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--quantiles", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 0.9])
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-start", default="2022-07-01")
    p.add_argument("--save", default="runs/volq/model.pt")
    return p.parse_args()


class VolumeWindows(Dataset):
    def __init__(self, panel, enc, dec, start=None, end=None):
        self.enc, self.dec = enc, dec
        self.series = []
        self.index = []
        for sid, (_, g) in enumerate(panel.groupby("ticker", sort=True)):
            past = g[PAST_COLS].to_numpy(np.float32)
            fut = g[FUTURE_COLS].to_numpy(np.float32)
            static = g[["sector_id", "cap_bucket"]].iloc[0].to_numpy(np.int64)
            dates = g["date"].to_numpy()
            self.series.append((past, fut, static))
            for t in range(enc, len(g) - dec + 1):
                if (start is None or dates[t] >= start) and (end is None or dates[t] < end):
                    self.index.append((sid, t))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        sid, t = self.index[i]
        past, fut, static = self.series[sid]
        return (torch.from_numpy(past[t - self.enc : t]), torch.from_numpy(fut[t : t + self.dec]),
                torch.from_numpy(static), torch.from_numpy(past[t : t + self.dec, 0]))


class Seq2SeqQuantile(nn.Module):
    def __init__(self, hidden, quantiles, n_sectors=11, n_caps=5):
        super().__init__()
        self.register_buffer("quantiles", torch.tensor(quantiles))
        self.sector = nn.Embedding(n_sectors, 8)
        self.cap = nn.Embedding(n_caps, 4)
        self.init_h = nn.Linear(12, hidden)
        self.encoder = nn.LSTM(len(PAST_COLS), hidden, batch_first=True)
        self.decoder = nn.LSTM(len(FUTURE_COLS), hidden, batch_first=True)
        self.out = nn.Linear(hidden, len(quantiles))

    def forward(self, past, fut, static):
        s = torch.cat([self.sector(static[:, 0]), self.cap(static[:, 1])], -1)
        h0 = torch.tanh(self.init_h(s)).unsqueeze(0)
        _, (h, c) = self.encoder(past, (h0, torch.zeros_like(h0)))
        dec, _ = self.decoder(fut, (h, c))
        q = self.out(dec)  # (B, dec_len, Q)
        # monotone quantiles: cumulative softplus increments above the lowest one
        base, inc = q[..., :1], nn.functional.softplus(q[..., 1:])
        return torch.cat([base, base + inc.cumsum(-1)], -1)


def pinball(pred, target, quantiles):
    diff = target.unsqueeze(-1) - pred
    return torch.maximum(quantiles * diff, (quantiles - 1) * diff).mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")

    panel = pd.read_parquet(args.panel)
    panel["date"] = pd.to_datetime(panel["date"])
    panel = panel.sort_values(["ticker", "date"])
    # per-ticker z-scoring of log volume with an expanding mean, no look-ahead
    grp = panel.groupby("ticker")["log_vol"]
    panel["log_vol"] = (panel["log_vol"] - grp.transform(lambda s: s.expanding().mean().shift(1))).fillna(0.0)
    val_start = np.datetime64(args.val_start)
    train_ds = VolumeWindows(panel, args.encoder_len, args.decoder_len, end=val_start)
    val_ds = VolumeWindows(panel, args.encoder_len, args.decoder_len, start=val_start)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size * 2, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = Seq2SeqQuantile(args.hidden, args.quantiles).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10)
    logger.info("train %d / val %d windows on %d GPUs", len(train_ds), len(val_ds), world)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (past, fut, static, y) in enumerate(train_loader):
            past, fut, static, y = (t.to(device, non_blocking=True) for t in (past, fut, static, y))
            pred = model(past, fut, static)
            loss = pinball(pred, y, model.quantiles)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step(epoch + i / len(train_loader))

        model.eval()
        agg = torch.zeros(3, device=device, dtype=torch.float64)  # pinball sum, coverage hits, n
        with torch.no_grad():
            for past, fut, static, y in val_loader:
                past, fut, static, y = (t.to(device, non_blocking=True) for t in (past, fut, static, y))
                pred = model(past, fut, static)
                q = model.module.quantiles
                agg[0] += pinball(pred, y, q).double() * y.numel()
                agg[1] += ((y >= pred[..., 0]) & (y <= pred[..., -1])).sum()
                agg[2] += y.numel()
        dist.all_reduce(agg)
        val_loss, coverage = (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item()
        logger.info("epoch %d val_pinball %.4f coverage(%.0f-%.0f) %.3f (%.0fs)", epoch, val_loss,
                    100 * args.quantiles[0], 100 * args.quantiles[-1], coverage, time.time() - t0)
        if rank == 0 and val_loss < best:
            best = val_loss
            os.makedirs(os.path.dirname(args.save), exist_ok=True)
            torch.save({"state_dict": model.module.state_dict(), "args": vars(args)}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
