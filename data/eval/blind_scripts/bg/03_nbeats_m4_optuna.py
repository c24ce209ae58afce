"""Optuna sweep for a generic N-BEATS model on M4 (one frequency at a time).

Rank 0 owns the Optuna study; every trial's hyper-parameters are broadcast to
the other ranks, which train the same trial with DDP and stop when rank 0
sends None.

    torchrun --nproc_per_node=4 03_nbeats_m4_optuna.py --freq Monthly --n-trials 40
"""
import argparse
import json
import os

import numpy as np
import optuna
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HORIZON = {"Yearly": 6, "Quarterly": 8, "Monthly": 18, "Weekly": 13, "Daily": 14, "Hourly": 48}


class NBeatsBlock(nn.Module):
    def __init__(self, lookback, horizon, width, n_layers):
        super().__init__()
        layers, d = [], lookback
        for _ in range(n_layers):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        self.fc = nn.Sequential(*layers)
        self.theta = nn.Linear(width, lookback + horizon)
        self.lookback = lookback

    def forward(self, x):
        theta = self.theta(self.fc(x))
        return theta[:, :self.lookback], theta[:, self.lookback:]


class NBeats(nn.Module):
    def __init__(self, lookback, horizon, n_blocks, width, n_layers):
        super().__init__()
        self.blocks = nn.ModuleList(NBeatsBlock(lookback, horizon, width, n_layers) for _ in range(n_blocks))

    def forward(self, x):
        residual, forecast = x.flip(dims=(1,)), 0.0
        for block in self.blocks:
            backcast, f = block(residual)
            residual = residual - backcast
            forecast = forecast + f
        return forecast


class M4Windows(Dataset):
    """Windows cut from the history of each series; the last `horizon` points of every
    series are held out for validation and never appear in a training target."""

    def __init__(self, series, lookback, horizon, max_windows_per_series=64, seed=0):
        rng = np.random.default_rng(seed)
        self.series, self.lookback, self.horizon = series, lookback, horizon
        index = []
        for sid, s in enumerate(series):
            last = len(s) - 2 * horizon  # last possible forecast start inside the train part
            if last < 1:
                continue
            starts = np.arange(max(1, last - 10 * horizon), last + 1)
            if len(starts) > max_windows_per_series:
                starts = rng.choice(starts, max_windows_per_series, replace=False)
            index.extend((sid, int(t)) for t in starts)
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        sid, t = self.index[i]
        return make_window(self.series[sid], t, self.lookback, self.horizon)


class M4Holdout(Dataset):
    def __init__(self, series, lookback, horizon):
        self.series, self.lookback, self.horizon = series, lookback, horizon

    def __len__(self):
        return len(self.series)

    def __getitem__(self, i):
        s = self.series[i]
        return make_window(s, len(s) - self.horizon, self.lookback, self.horizon)


def make_window(s, t, lookback, horizon):
    x = s[max(0, t - lookback):t]
    if len(x) < lookback:
        x = np.concatenate([np.full(lookback - len(x), x[0], dtype=np.float32), x])
    y = s[t:t + horizon]
    scale = max(np.abs(x).max(), 1e-3)
    return torch.from_numpy(x / scale), torch.from_numpy(y / scale), torch.tensor(scale)


def load_m4(path):
    df = pd.read_csv(path).set_index("V1")
    return [row.dropna().to_numpy(np.float32) for _, row in df.iterrows()]


def smape(pred, target):
    return 200.0 * (pred - target).abs() / (pred.abs() + target.abs()).clamp_min(1e-8)


def run_trial(params, series, horizon, args, device, trial=None):
    """Runs on every rank with the same params; only rank 0 holds the Optuna trial."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lookback = params["lookback_mult"] * horizon
    train_ds = M4Windows(series, lookback, horizon, seed=args.seed)
    val_ds = M4Holdout(series, lookback, horizon)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=params["batch_size"], sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=2048)

    torch.manual_seed(args.seed)
    net = NBeats(lookback, horizon, params["n_blocks"], params["width"], params["n_layers"]).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.Adam(model.parameters(), lr=params["lr"])

    score = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = (model(x) - y).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y, scale in val_loader:
                x, y, scale = x.to(device), y.to(device), scale.to(device).unsqueeze(1)
                s = smape(net(x) * scale, y * scale)
                acc[0] += s.sum()
                acc[1] += s.numel()
        dist.all_reduce(acc)
        score = (acc[0] / acc[1]).item()

        prune = False
        if trial is not None:
            trial.report(score, epoch)
            prune = trial.should_prune()
        flag = [prune]
        dist.broadcast_object_list(flag, src=0)
        if flag[0]:
            return score, True
    return score, False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="data/m4")
    ap.add_argument("--freq", default="Monthly", choices=list(HORIZON))
    ap.add_argument("--n-trials", type=int, default=40)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="sweeps/nbeats_m4")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    horizon = HORIZON[args.freq]
    series = load_m4(os.path.join(args.data_dir, f"{args.freq}-train.csv"))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

        def objective(trial):
            params = {
                "lr": trial.suggest_float("lr", 1e-4, 3e-3, log=True),
                "n_blocks": trial.suggest_int("n_blocks", 4, 30),
                "n_layers": trial.suggest_int("n_layers", 2, 4),
                "width": trial.suggest_categorical("width", [256, 512, 1024]),
                "lookback_mult": trial.suggest_int("lookback_mult", 2, 7),
                "batch_size": trial.suggest_categorical("batch_size", [256, 512, 1024]),
            }
            dist.broadcast_object_list([params], src=0)
            score, pruned = run_trial(params, series, horizon, args, device, trial)
            if pruned:
                raise optuna.TrialPruned()
            return score

        study = optuna.create_study(
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=args.seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=3),
        )
        try:
            study.optimize(objective, n_trials=args.n_trials)
        finally:
            dist.broadcast_object_list([None], src=0)  # release the other ranks

        study.trials_dataframe().to_csv(os.path.join(args.out, f"trials_{args.freq}.csv"), index=False)
        with open(os.path.join(args.out, f"best_{args.freq}.json"), "w") as f:
            json.dump({"value": study.best_value, "params": study.best_params}, f, indent=2)
        print(f"best sMAPE {study.best_value:.3f} with {study.best_params}", flush=True)
    else:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                break
            run_trial(msg[0], series, horizon, args, device)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
