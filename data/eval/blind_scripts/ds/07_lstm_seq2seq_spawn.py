"""LSTM encoder-decoder for hourly store footfall -> staffing forecasts.

Started as a plain python script on a single workstation; it spawns one
process per visible GPU itself:

    python 07_lstm_seq2seq_spawn.py --csv data/footfall_hourly.csv --gpus 4
"""
import argparse
import os
import socket
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


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_cache(csv_path, cache_path, history_days):
    df = pd.read_csv(csv_path, parse_dates=["ts"])
    df = df[df["ts"] >= df["ts"].max() - pd.Timedelta(days=history_days)]
    wide = df.pivot_table(index="store_id", columns="ts", values="visitors", aggfunc="sum")
    wide = wide.sort_index().sort_index(axis=1).fillna(0.0)
    hours = wide.columns.hour.to_numpy()
    dows = wide.columns.dayofweek.to_numpy()
    tmp = cache_path + ".tmp.npz"
    np.savez(tmp, values=wide.to_numpy(np.float32), hours=hours, dows=dows,
             stores=wide.index.to_numpy())
    os.replace(tmp, cache_path)


class HourlyWindows(Dataset):
    def __init__(self, values, calendar, mean, std, enc, dec, end, stride):
        self.values, self.calendar = values, calendar
        self.mean, self.std = mean, std
        self.enc, self.dec = enc, dec
        starts = np.arange(0, end - enc - dec + 1, stride)
        self.index = [(s, t) for s in range(values.shape[0]) for t in starts]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        v = (self.values[s, t:t + self.enc + self.dec] - self.mean[s]) / self.std[s]
        cal = self.calendar[t:t + self.enc + self.dec]
        return torch.from_numpy(v), torch.from_numpy(cal)


def calendar_features(hours, dows):
    return np.stack([np.sin(2 * np.pi * hours / 24), np.cos(2 * np.pi * hours / 24),
                     np.sin(2 * np.pi * dows / 7), np.cos(2 * np.pi * dows / 7)], -1).astype(np.float32)


class Seq2Seq(nn.Module):
    def __init__(self, n_cal, hidden, layers, dropout):
        super().__init__()
        self.encoder = nn.LSTM(1 + n_cal, hidden, layers, batch_first=True, dropout=dropout)
        self.decoder = nn.LSTM(n_cal, hidden, layers, batch_first=True, dropout=dropout)
        self.proj = nn.Linear(hidden, 1)

    def forward(self, y_enc, cal_enc, cal_dec):
        _, state = self.encoder(torch.cat([y_enc.unsqueeze(-1), cal_enc], -1))
        out, _ = self.decoder(cal_dec, state)
        return self.proj(out).squeeze(-1)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    cache = os.path.join(args.cache_dir, f"footfall_{args.history_days}d.npz")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(args.cache_dir, exist_ok=True)
        build_cache(args.csv, cache, args.history_days)
    dist.barrier()
    z = np.load(cache, allow_pickle=True)
    values, cal = z["values"], calendar_features(z["hours"], z["dows"])

    T = values.shape[1]
    train_end = T - args.n_origins * args.dec
    mean = values[:, :train_end].mean(1)
    std = values[:, :train_end].std(1) + 1.0
    ds = HourlyWindows(values, cal, mean, std, args.enc, args.dec, train_end, stride=6)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)

    model = DDP(Seq2Seq(cal.shape[1], args.hidden, args.layers, 0.1).to(device), device_ids=[rank])
    # lr follows the global batch: base lr was tuned at 256 windows per step
    lr = args.base_lr * (args.batch_size * world_size) / 256
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader))

    start = 0
    ckpt_path = os.path.join(args.out_dir, "checkpoint.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for y, c in loader:
            y, c = y.to(device, non_blocking=True), c.to(device, non_blocking=True)
            pred = model(y[:, :args.enc], c[:, :args.enc], c[:, args.enc:])
            loss = nn.functional.smooth_l1_loss(pred, y[:, args.enc:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(agg)

        # backtest on this rank's stores, sums combined across ranks
        net = model.module.eval()
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        mine = np.arange(rank, values.shape[0], world_size)
        with torch.no_grad():
            for k in range(args.n_origins, 0, -1):
                cut = T - k * args.dec
                if len(mine) == 0:
                    break
                x = torch.from_numpy((values[mine, cut - args.enc:cut] - mean[mine, None]) / std[mine, None])
                ce = torch.from_numpy(cal[cut - args.enc:cut]).expand(len(mine), -1, -1)
                cd = torch.from_numpy(cal[cut:cut + args.dec]).expand(len(mine), -1, -1)
                p = net(x.to(device), ce.to(device), cd.to(device)).cpu().numpy()
                p = np.clip(p * std[mine, None] + mean[mine, None], 0, None)
                t = values[mine, cut:cut + args.dec]
                stats[0] += float(np.abs(p - t).sum())
                stats[1] += float(t.sum())
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} "
                  f"wape {(stats[0] / stats[1]).item():.4f} [{time.time() - t0:.0f}s]", flush=True)
            os.makedirs(args.out_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/footfall_hourly.csv")
    p.add_argument("--cache_dir", default="cache")
    p.add_argument("--out_dir", default="runs/footfall_seq2seq")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--history_days", type=int, default=730)
    p.add_argument("--enc", type=int, default=336)
    p.add_argument("--dec", type=int, default=48)
    p.add_argument("--n_origins", type=int, default=7)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--base_lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
