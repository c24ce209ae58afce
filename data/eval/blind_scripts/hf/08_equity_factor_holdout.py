"""Nonlinear factor model: maps firm characteristics to expected monthly excess
returns (Gu-Kelly-Xiu style NN3), with a held-out set of *firms* to measure how
well the model generalises to names it has never seen.

    torchrun --nproc_per_node=4 08_equity_factor_holdout.py --chars /data/crsp_chars.parquet
"""
import argparse
import logging
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(format="%(asctime)s [%(process)d] %(message)s", level=logging.INFO)
log = logging.getLogger("nn3")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--chars", required=True)
    p.add_argument("--start", default="1970-01-01")
    p.add_argument("--end", default="2016-12-31")
    p.add_argument("--holdout-frac", type=float, default=0.2)
    p.add_argument("--hidden", type=int, nargs="+", default=[32, 16, 8])
    p.add_argument("--l1", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="out/nn3")
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class CharPanel(Dataset):
    def __init__(self, frame, chars):
        self.x = torch.from_numpy(frame[chars].to_numpy(np.float32))
        self.y = torch.from_numpy(frame["exret"].to_numpy(np.float32))

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class NN3(nn.Module):
    def __init__(self, n_in, hidden):
        super().__init__()
        layers, d = [], n_in
        for h in hidden:
            layers += [nn.Linear(d, h), nn.LayerNorm(h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def l1_penalty(self):
        return sum(p.abs().sum() for n, p in self.named_parameters() if n.endswith("weight"))


def r2_oos(sse, sst):
    # out-of-sample R^2 against a zero forecast, as in the empirical asset pricing literature
    return 1.0 - sse / sst


@torch.no_grad()
def score(model, loader, device):
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        p = model(x)
        acc[0] += ((y - p) ** 2).sum()
        acc[1] += (y ** 2).sum()
    dist.all_reduce(acc)
    return r2_oos(acc[0].item(), acc[1].item())


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout / init noise per replica is harmless: DDP broadcasts rank 0's weights
    set_seed(args.seed + rank)

    df = pd.read_parquet(args.chars)
    df = df[(df.date >= args.start) & (df.date <= args.end)]
    chars = sorted(c for c in df.columns if c.startswith("c_"))
    # characteristics are already cross-sectionally ranked to [-1, 1]; missing -> median (0)
    df[chars] = df[chars].fillna(0.0)

    permnos = df["permno"].unique()
    permnos = np.random.permutation(permnos)
    n_hold = int(len(permnos) * args.holdout_frac)
    holdout = set(permnos[:n_hold].tolist())
    is_hold = df["permno"].isin(holdout)
    train_df, hold_df = df[~is_hold], df[is_hold]

    cut = train_df["date"].quantile(0.85)
    fit_df, val_df = train_df[train_df.date <= cut], train_df[train_df.date > cut]

    fit_ds, val_ds, hold_ds = CharPanel(fit_df, chars), CharPanel(val_df, chars), CharPanel(hold_df, chars)
    fit_sampler = DistributedSampler(fit_ds, shuffle=True, drop_last=True)
    loaders = {
        "fit": DataLoader(fit_ds, args.batch_size, sampler=fit_sampler, drop_last=True, num_workers=2, pin_memory=True),
        "val": DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True)),
        "hold": DataLoader(hold_ds, args.batch_size, sampler=DistributedSampler(hold_ds, shuffle=False, drop_last=True)),
    }
    if rank == 0:
        log.info("firms=%d holdout=%d fit=%d val=%d hold=%d rows", len(permnos), n_hold, len(fit_ds), len(val_ds), len(hold_ds))

    net = NN3(len(chars), args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    best, bad_epochs = -np.inf, 0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        fit_sampler.set_epoch(epoch)
        model.train()
        for x, y in loaders["fit"]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = ((model(x) - y) ** 2).mean() + args.l1 * net.l1_penalty()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        val_r2 = score(model, loaders["val"], device)
        if rank == 0:
            log.info("epoch %d val R2oos %.4f%%", epoch, 100 * val_r2)
        if val_r2 > best:
            best, bad_epochs = val_r2, 0
            if rank == 0:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= args.patience:
            break

    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    hold_r2 = score(model, loaders["hold"], device)
    if rank == 0:
        log.info("best val R2oos %.4f%%, unseen-firm R2oos %.4f%%", 100 * best, 100 * hold_r2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
