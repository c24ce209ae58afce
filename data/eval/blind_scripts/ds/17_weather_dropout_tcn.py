"""Store-level TCN with an optional weather / local-event branch.

Weather forecasts are missing for roughly a fifth of the stores at prediction
time, so during training the whole weather branch is switched off for a random
share of batches ("branch dropout").  The model is then usable with or without
weather input.

    torchrun --nproc_per_node=8 17_weather_dropout_tcn.py --sales /data/store_sales.parquet \
        --weather /data/store_weather.parquet --out /models/tcn_weather
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

WEATHER_COLS = ["tmax", "tmin", "precip_mm", "snow_cm", "event_flag"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--sales", default="/data/store_sales.parquet")
    p.add_argument("--weather", default="/data/store_weather.parquet")
    p.add_argument("--out", default="/models/tcn_weather")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--context", type=int, default=91)
    p.add_argument("--horizon", type=int, default=14)
    p.add_argument("--test_days", type=int, default=42)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--levels", type=int, default=6)
    p.add_argument("--p_drop_weather", type=float, default=0.2)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load(sales_path, weather_path):
    s = pd.read_parquet(sales_path)
    w = pd.read_parquet(weather_path)
    sales = s.pivot_table(index="store", columns="date", values="net_sales", aggfunc="sum").fillna(0.0)
    sales = sales.sort_index()
    weather = np.stack([w.pivot_table(index="store", columns="date", values=c)
                        .reindex(index=sales.index, columns=sales.columns)
                        .interpolate(axis=1, limit_direction="both").fillna(0.0).to_numpy(np.float32)
                        for c in WEATHER_COLS], 1)
    mu = weather.mean((0, 2), keepdims=True)
    sd = weather.std((0, 2), keepdims=True) + 1e-3
    return sales.to_numpy(np.float32), (weather - mu) / sd


class StoreWindows(Dataset):
    def __init__(self, sales, weather, scale, c, h, end):
        self.sales, self.weather, self.scale, self.c, self.h = sales, weather, scale, c, h
        self.ix = [(s, t) for s in range(len(sales)) for t in range(0, end - c - h + 1)]

    def __len__(self):
        return len(self.ix)

    def __getitem__(self, i):
        s, t = self.ix[i]
        y = self.sales[s, t:t + self.c + self.h] / self.scale[s]
        wx = self.weather[s, :, t:t + self.c + self.h]
        return torch.from_numpy(y[:self.c]), torch.from_numpy(wx), torch.from_numpy(y[self.c:])


class ResBlock(nn.Module):
    def __init__(self, ch, dilation):
        super().__init__()
        self.pad = 2 * dilation
        self.conv = nn.Conv1d(ch, ch, 3, dilation=dilation)
        self.bn = nn.BatchNorm1d(ch)

    def forward(self, x):
        return x + F.gelu(self.bn(self.conv(F.pad(x, (self.pad, 0)))))


class WeatherTCN(nn.Module):
    def __init__(self, ch, levels, context, horizon, n_weather):
        super().__init__()
        self.context = context
        self.inp = nn.Conv1d(1, ch, 1)
        self.trunk = nn.Sequential(*[ResBlock(ch, 2 ** i) for i in range(levels)])
        # weather branch: Linear/LayerNorm only, so skipping it does not skip any BatchNorm
        self.weather_enc = nn.Sequential(nn.Linear(n_weather * (context + horizon), 2 * ch), nn.GELU(),
                                         nn.LayerNorm(2 * ch), nn.Linear(2 * ch, ch))
        self.head = nn.Sequential(nn.Linear(ch, ch), nn.GELU(), nn.Linear(ch, horizon))

    def forward(self, y_hist, weather=None):
        h = self.trunk(self.inp(y_hist.unsqueeze(1)))[..., -1]
        if weather is not None:
            h = h + self.weather_enc(weather.flatten(1))
        return self.head(h)


@torch.no_grad()
def evaluate(net, sales, weather, scale, args, rank, world, device, use_weather):
    net.eval()
    T = sales.shape[1]
    rows = np.arange(rank, len(sales), world)
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for cut in range(T - args.test_days, T - args.horizon + 1, args.horizon):
        if len(rows) == 0:
            break
        x = torch.from_numpy(sales[rows, cut - args.context:cut] / scale[rows, None]).to(device)
        wx = torch.from_numpy(weather[rows, :, cut - args.context:cut + args.horizon]).to(device)
        p = net(x, wx if use_weather else None).double() * torch.from_numpy(scale[rows, None]).to(device)
        t = torch.from_numpy(sales[rows, cut:cut + args.horizon]).to(device).double()
        acc[0] += (p.clamp_min(0) - t).abs().sum()
        acc[1] += t.sum()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    branch_rng = torch.Generator().manual_seed(args.seed + 1000 * rank)

    sales, weather = load(args.sales, args.weather)
    T = sales.shape[1]
    train_end = T - args.test_days
    scale = np.maximum(sales[:, :train_end].mean(1), 1.0).astype(np.float32)
    ds = StoreWindows(sales, weather, scale, args.context, args.horizon, train_end)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = WeatherTCN(args.channels, args.levels, args.context, args.horizon, len(WEATHER_COLS))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    # the weather branch is skipped on some steps (per rank), so some parameters get no grad
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * world * args.batch_size / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start_epoch, best = 0, float("inf")
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, wx, y in loader:
            x, wx, y = x.to(device, non_blocking=True), wx.to(device, non_blocking=True), y.to(device)
            drop = torch.rand((), generator=branch_rng).item() < args.p_drop_weather
            pred = model(x, None if drop else wx)
            loss = F.l1_loss(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        w_on = evaluate(model.module, sales, weather, scale, args, rank, world, device, True)
        w_off = evaluate(model.module, sales, weather, scale, args, rank, world, device, False)
        best = min(best, w_on)
        if rank == 0:
            print(f"epoch {epoch} l1 {(tot[0] / tot[1]).item():.4f} wape(weather) {w_on:.4f} "
                  f"wape(no weather) {w_off:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "best": best}, ckpt_path)
            if w_on <= best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
