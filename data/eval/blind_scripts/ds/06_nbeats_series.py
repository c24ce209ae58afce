"""N-BEATS (generic) global model over SKU-location daily demand.

Model selection uses a hold-out set of *series* (cold-start style validation):
10% of the series are never trained on and are forecast from their history only.

    torchrun --nproc_per_node=8 06_nbeats_series.py --data /data/demand/sku_loc_daily.parquet
"""
import argparse
import logging
import os
import random
import sys

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="N-BEATS demand training")
    p.add_argument("--data", default="/data/demand/sku_loc_daily.parquet")
    p.add_argument("--output_dir", default="outputs/nbeats")
    p.add_argument("--lookback_mult", type=int, default=4)
    p.add_argument("--horizon", type=int, default=14)
    p.add_argument("--stacks", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--val_frac", type=float, default=0.1)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args(argv)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_series(path):
    df = pd.read_parquet(path)
    df["key"] = df["sku"].astype(str) + "@" + df["location"].astype(str)
    wide = df.pivot_table(index="key", columns="date", values="qty", aggfunc="sum").fillna(0.0)
    wide = wide.sort_index()
    # drop series with almost no history
    active = (wide.to_numpy() > 0).sum(1) >= 60
    wide = wide[active]
    return wide.index.tolist(), wide.to_numpy(np.float32)


class NBeatsWindows(Dataset):
    def __init__(self, values, rows, lookback, horizon, end):
        self.values = values
        self.lookback, self.horizon = lookback, horizon
        self.samples = [(r, t) for r in rows for t in range(lookback, end - horizon + 1, 2)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        r, t = self.samples[i]
        x = self.values[r, t - self.lookback:t]
        y = self.values[r, t:t + self.horizon]
        level = max(float(x.mean()), 1.0)   # scale by the window's own level
        return torch.from_numpy(x / level), torch.from_numpy(y / level)


class Block(nn.Module):
    def __init__(self, lookback, horizon, width, layers):
        super().__init__()
        fc = [nn.Linear(lookback, width), nn.ReLU()]
        for _ in range(layers - 1):
            fc += [nn.Linear(width, width), nn.ReLU()]
        self.fc = nn.Sequential(*fc)
        self.backcast = nn.Linear(width, lookback)
        self.forecast = nn.Linear(width, horizon)

    def forward(self, x):
        h = self.fc(x)
        return self.backcast(h), self.forecast(h)


class NBeats(nn.Module):
    def __init__(self, lookback, horizon, stacks, layers, width):
        super().__init__()
        self.blocks = nn.ModuleList([Block(lookback, horizon, width, layers) for _ in range(stacks)])

    def forward(self, x):
        residual, forecast = x, 0.0
        for block in self.blocks:
            b, f = block(residual)
            residual = residual - b
            forecast = forecast + f
        return forecast


def smape(pred, true):
    denom = pred.abs() + true.abs()
    return torch.where(denom > 0, 2 * (pred - true).abs() / denom, torch.zeros_like(denom))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    # different dropout / augmentation streams per rank
    seed_all(args.seed + rank)

    keys, values = load_series(args.data)
    n_series, T = values.shape
    lookback = args.lookback_mult * args.horizon

    rows = list(range(n_series))
    random.shuffle(rows)
    n_val = int(args.val_frac * n_series)
    val_rows, train_rows = sorted(rows[:n_val]), sorted(rows[n_val:])

    # last horizon of every series is reserved as the test period
    train_end = T - args.horizon
    train_ds = NBeatsWindows(values, train_rows, lookback, args.horizon, train_end)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.workers, pin_memory=True)

    model = NBeats(lookback, args.horizon, args.stacks, args.layers, args.width).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    milestones = [int(args.epochs * f) for f in (0.5, 0.75)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.3)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    logger.info("series: %d train / %d val, windows: %d, steps/epoch: %d",
                len(train_rows), len(val_rows), len(train_ds), len(loader))

    best_smape = float("inf")
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        train_loss = torch.zeros(2, device=device)
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            loss = (model(x) - y).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_loss += torch.stack([loss.detach(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(train_loss)

        # validation: last window before the test period of each held-out series
        net = model.module
        net.eval()
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        my_val = val_rows[rank::world]
        with torch.no_grad():
            for b in range(0, len(my_val), 4096):
                r = my_val[b:b + 4096]
                x = values[r, train_end - args.horizon - lookback:train_end - args.horizon]
                y = values[r, train_end - args.horizon:train_end]
                level = np.maximum(x.mean(1, keepdims=True), 1.0)
                pred = net(torch.from_numpy(x / level).to(device)) * torch.from_numpy(level).to(device)
                s = smape(pred.clamp_min(0), torch.from_numpy(y).to(device))
                acc[0] += s.sum().double()
                acc[1] += s.numel()
        dist.all_reduce(acc)
        val_smape = (acc[0] / acc[1].clamp_min(1)).item()
        logger.info("epoch %d train_mae %.4f val_smape %.4f", epoch,
                    (train_loss[0] / train_loss[1]).item(), val_smape)

        if rank == 0 and val_smape < best_smape:
            best_smape = val_smape
            torch.save({"model": net.state_dict(), "epoch": epoch, "val_smape": val_smape,
                        "val_keys": [keys[r] for r in val_rows], "args": vars(args)},
                       os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
