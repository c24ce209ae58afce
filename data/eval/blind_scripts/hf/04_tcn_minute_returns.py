"""Temporal convolutional network for 5-minute-ahead return forecasting on
1-minute futures bars (ES, NQ, CL, GC, ZN ...).

    torchrun --standalone --nproc_per_node=4 04_tcn_minute_returns.py --config configs/tcn_es.yaml
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("tcn")

DEFAULTS = dict(
    bars="/data/futures/1min_bars.npz",
    lookback=240,
    horizon=5,
    channels=[64, 64, 64, 64, 64, 64],
    kernel=3,
    dropout=0.1,
    batch_size=512,
    epochs=30,
    lr=1e-3,
    weight_decay=1e-5,
    val_frac=0.15,
    out_dir="runs/tcn",
    amp=True,
)


class BarWindows(Dataset):
    """npz with `x` (T, F) float32 features and `ret` (T,) log returns of the front contract."""

    def __init__(self, x, ret, lookback, horizon, lo, hi):
        self.x, self.ret = x, ret
        self.lookback, self.horizon = lookback, horizon
        self.starts = np.arange(max(lo, lookback), hi - horizon)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        t = self.starts[i]
        window = self.x[t - self.lookback : t]
        target = self.ret[t : t + self.horizon].sum()
        return torch.from_numpy(window.T.copy()), torch.tensor(target * 1e4, dtype=torch.float32)  # bps


class Chomp(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x[:, :, : -self.n].contiguous()


class TemporalBlock(nn.Module):
    def __init__(self, cin, cout, kernel, dilation, dropout):
        super().__init__()
        pad = (kernel - 1) * dilation
        self.net = nn.Sequential(
            weight_norm(nn.Conv1d(cin, cout, kernel, padding=pad, dilation=dilation)), Chomp(pad), nn.GELU(), nn.Dropout(dropout),
            weight_norm(nn.Conv1d(cout, cout, kernel, padding=pad, dilation=dilation)), Chomp(pad), nn.GELU(), nn.Dropout(dropout),
        )
        self.down = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return torch.relu(self.net(x) + self.down(x))


class TCN(nn.Module):
    def __init__(self, n_in, channels, kernel, dropout):
        super().__init__()
        blocks, cin = [], n_in
        for i, c in enumerate(channels):
            blocks.append(TemporalBlock(cin, c, kernel, 2 ** i, dropout))
            cin = c
        self.tcn = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, 1)

    def forward(self, x):
        return self.head(self.tcn(x)[:, :, -1]).squeeze(-1)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as fh:
            cfg.update(yaml.safe_load(fh) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)  # se, n, sum(pred*y), hits
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = model(x)
        acc += torch.stack([((p - y) ** 2).sum(), torch.tensor(float(len(y)), device=device),
                            (p * y).sum(), (torch.sign(p) == torch.sign(y)).sum()]).double()
    dist.all_reduce(acc)
    return {"rmse_bps": (acc[0] / acc[1]).sqrt().item(), "hit_rate": (acc[3] / acc[1]).item()}


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")
    if rank != 0:
        logger.setLevel(logging.WARNING)

    data = np.load(cfg.bars)
    x, ret = data["x"].astype(np.float32), data["ret"].astype(np.float64)
    split = int(len(ret) * (1 - cfg.val_frac))
    mu, sd = np.nanmean(x[:split], 0), np.nanstd(x[:split], 0) + 1e-8
    x = (x - mu) / sd  # session gaps and roll days stay NaN

    train_ds = BarWindows(x, ret, cfg.lookback, cfg.horizon, 0, split)
    val_ds = BarWindows(np.nan_to_num(x), np.nan_to_num(ret), cfg.lookback, cfg.horizon, split, len(ret))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, cfg.batch_size, sampler=val_sampler, num_workers=2, pin_memory=True, drop_last=True)

    model = TCN(x.shape[1], cfg.channels, cfg.kernel, cfg.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_steps = cfg.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total_steps, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
    loss_fn = nn.HuberLoss(delta=10.0)

    start_epoch = 0
    if cfg.resume:
        state = torch.load(cfg.resume, map_location=device)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1

    os.makedirs(cfg.out_dir, exist_ok=True)
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, skipped = time.time(), 0
        running = torch.zeros(2, device=device)
        for step, (xb, yb) in enumerate(train_loader):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                loss = loss_fn(model(xb), yb)
            if not torch.isfinite(loss):
                skipped += 1
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 200 == 0 and rank == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(), sched.get_last_lr()[0])

        dist.all_reduce(running)
        metrics = validate(model, val_loader, device)
        logger.info("epoch %d train_loss %.4f val_rmse %.2fbps hit %.4f skipped %d (%.0fs)", epoch,
                    (running[0] / running[1].clamp(min=1)).item(), metrics["rmse_bps"], metrics["hit_rate"],
                    skipped, time.time() - t0)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch, "cfg": vars(cfg)},
                       os.path.join(cfg.out_dir, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
