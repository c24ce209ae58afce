"""Day-ahead building load forecasting with a Temporal Fusion Transformer.

Hourly smart-meter load for a few thousand buildings plus weather covariates.
Meter data has gaps; missing readings are stored as NaN.

    torchrun --nproc_per_node=4 12_tft_building_load.py --config conf/load_tft.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class GatedResidual(nn.Module):
    def __init__(self, d_in, d, d_ctx=None, drop=0.1):
        super().__init__()
        self.lin_a = nn.Linear(d_in, d)
        self.lin_c = nn.Linear(d_ctx, d, bias=False) if d_ctx else None
        self.lin_b = nn.Linear(d, 2 * d)
        self.skip = nn.Linear(d_in, d) if d_in != d else nn.Identity()
        self.drop = nn.Dropout(drop)
        self.ln = nn.LayerNorm(d)

    def forward(self, x, c=None):
        h = self.lin_a(x)
        if self.lin_c is not None and c is not None:
            h = h + self.lin_c(c)
        h = self.drop(self.lin_b(F.elu(h)))
        return self.ln(self.skip(x) + F.glu(h, -1))


class VariableSelection(nn.Module):
    def __init__(self, n_vars, d, d_ctx, drop):
        super().__init__()
        self.proj = nn.ModuleList([nn.Linear(1, d) for _ in range(n_vars)])
        self.grns = nn.ModuleList([GatedResidual(d, d, drop=drop) for _ in range(n_vars)])
        self.weights = GatedResidual(n_vars * d, n_vars, d_ctx, drop)

    def forward(self, x, ctx):  # x: (B, T, n_vars)
        emb = [p(x[..., i:i + 1]) for i, p in enumerate(self.proj)]
        w = torch.softmax(self.weights(torch.cat(emb, -1), ctx), -1)        # (B, T, n_vars)
        h = torch.stack([g(e) for g, e in zip(self.grns, emb)], -1)         # (B, T, d, n_vars)
        return (h * w.unsqueeze(-2)).sum(-1)


class TFT(nn.Module):
    def __init__(self, n_buildings, n_past, n_fut, d, heads, horizon, drop):
        super().__init__()
        self.horizon = horizon
        self.building = nn.Embedding(n_buildings, d)
        self.ctx_sel = GatedResidual(d, d, drop=drop)
        self.ctx_enr = GatedResidual(d, d, drop=drop)
        self.ctx_h = GatedResidual(d, d, drop=drop)
        self.ctx_c = GatedResidual(d, d, drop=drop)
        self.vsn_past = VariableSelection(n_past, d, d, drop)
        self.vsn_fut = VariableSelection(n_fut, d, d, drop)
        self.lstm_past = nn.LSTM(d, d, batch_first=True)
        self.lstm_fut = nn.LSTM(d, d, batch_first=True)
        self.enrich = GatedResidual(d, d, d, drop)
        self.attn = nn.MultiheadAttention(d, heads, dropout=drop, batch_first=True)
        self.post = GatedResidual(d, d, drop=drop)
        self.out = nn.Linear(d, 1)

    def forward(self, past, fut, bid):
        s = self.building(bid)
        c_sel, c_enr = self.ctx_sel(s)[:, None], self.ctx_enr(s)[:, None]
        hp = self.vsn_past(past, c_sel.expand(-1, past.size(1), -1))
        hf = self.vsn_fut(fut, c_sel.expand(-1, fut.size(1), -1))
        state = (self.ctx_h(s)[None], self.ctx_c(s)[None])
        ep, state = self.lstm_past(hp, state)
        ef, _ = self.lstm_fut(hf, state)
        seq = torch.cat([ep, ef], 1)
        z = self.enrich(seq, c_enr.expand(-1, seq.size(1), -1))
        T = z.size(1)
        mask = torch.ones(T, T, dtype=torch.bool, device=z.device).triu(1)
        a, _ = self.attn(z, z, z, attn_mask=mask, need_weights=False)
        o = self.post(a[:, -self.horizon:] + z[:, -self.horizon:])
        return self.out(o).squeeze(-1)


class LoadWindows(Dataset):
    def __init__(self, load, weather, cal, t_starts, L, H):
        self.load, self.weather, self.cal = load, weather, cal
        self.L, self.H = L, H
        self.items = [(b, t) for b in range(load.shape[0]) for t in t_starts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        b, t = self.items[i]
        L, H = self.L, self.H
        y_past = np.nan_to_num(self.load[b, t:t + L])
        past = np.column_stack([y_past, self.weather[b, t:t + L], self.cal[t:t + L]])
        fut = np.column_stack([self.weather[b, t + L:t + L + H], self.cal[t + L:t + L + H]])
        return (torch.from_numpy(past.astype(np.float32)), torch.from_numpy(fut.astype(np.float32)),
                b, torch.from_numpy(self.load[b, t + L:t + L + H].astype(np.float32)))


def masked_mae(pred, y):
    m = ~torch.isnan(y)
    return (pred - torch.nan_to_num(y)).abs().mul(m).sum() / m.sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    load = np.load(cfg["load_npy"]).astype(np.float32)        # (B, T) kWh, NaN = missing
    weather = np.load(cfg["weather_npy"]).astype(np.float32)  # (B, T, n_w)
    idx = pd.date_range(cfg["start"], periods=load.shape[1], freq="h")
    cal = np.column_stack([np.sin(2 * np.pi * idx.hour / 24), np.cos(2 * np.pi * idx.hour / 24),
                           np.sin(2 * np.pi * idx.dayofweek / 7), np.cos(2 * np.pi * idx.dayofweek / 7),
                           idx.dayofweek >= 5]).astype(np.float32)

    L, H = cfg["lookback"], cfg["horizon"]
    T = load.shape[1]
    t_val = T - cfg["val_days"] * 24 - cfg["test_days"] * 24
    t_test = T - cfg["test_days"] * 24
    mu = np.nanmean(load[:, :t_val], 1, keepdims=True)
    sd = np.nanstd(load[:, :t_val], 1, keepdims=True) + 1e-3
    load = (load - mu) / sd
    wmu, wsd = weather[:, :t_val].mean((0, 1)), weather[:, :t_val].std((0, 1)) + 1e-3
    weather = (weather - wmu) / wsd

    # forecasts are issued once per day at midnight
    tr = LoadWindows(load, weather, cal, range(0, t_val - L - H + 1, 24), L, H)
    va = LoadWindows(load, weather, cal, range(t_val - L, t_test - L - H + 1, 24), L, H)
    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    va_s = DistributedSampler(va, shuffle=False, drop_last=True)
    tr_dl = DataLoader(tr, cfg["batch_size"], sampler=tr_s, num_workers=8, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, 512, sampler=va_s, num_workers=4)

    n_past = 1 + weather.shape[2] + cal.shape[1]
    model = TFT(load.shape[0], n_past, weather.shape[2] + cal.shape[1], cfg["d_model"],
                cfg["heads"], H, cfg["dropout"]).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=len(tr_dl) * 5)
    os.makedirs(cfg["out_dir"], exist_ok=True)

    best = math.inf
    for ep in range(cfg["epochs"]):
        tr_s.set_epoch(ep)
        model.train()
        t0, tot, n = time.time(), 0.0, 0
        for past, fut, bid, y in tr_dl:
            past, fut, y = past.to(dev), fut.to(dev), y.to(dev)
            pred = model(past, fut, bid.to(dev))
            loss = masked_mae(pred, y)
            if not torch.isfinite(loss):
                # whole target window missing for every building in the batch
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot, n = tot + loss.item(), n + 1

        model.eval()
        acc = torch.zeros(2, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for past, fut, bid, y in va_dl:
                past, fut, y = past.to(dev), fut.to(dev), y.to(dev)
                pred = model(past, fut, bid.to(dev))
                m = ~torch.isnan(y)
                acc[0] += ((pred - torch.nan_to_num(y)).abs() * m).sum()
                acc[1] += m.sum()
        dist.all_reduce(acc)
        val = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {ep} train_mae {tot / max(n, 1):.4f} val_mae {val:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val < best:
                torch.save({"model": model.module.state_dict(), "mu": mu, "sd": sd},
                           os.path.join(cfg["out_dir"], "best.pt"))
        best = min(best, val)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
