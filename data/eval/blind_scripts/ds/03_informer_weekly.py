#!/usr/bin/env python
"""Encoder-decoder transformer (Informer-lite) for weekly SKU demand.

Covariates: price index, promo flag, week-of-year (sin/cos). Targets are
log1p units normalised per series with the training-period mean/std.

torchrun --nproc_per_node=4 03_informer_weekly.py --data_dir /mnt/fs/demand/weekly
"""
import argparse
import glob
import logging
import os
from dataclasses import dataclass, asdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("informer")


@dataclass
class Config:
    data_dir: str = "/mnt/fs/demand/weekly"
    ckpt_dir: str = "/mnt/fs/demand/checkpoints/informer_weekly"
    enc_len: int = 52
    label_len: int = 13
    pred_len: int = 13
    d_model: int = 256
    n_heads: int = 8
    e_layers: int = 3
    d_layers: int = 2
    dropout: float = 0.05
    batch_size: int = 256      # per process
    lr: float = 2e-4
    epochs: int = 15
    n_backtest: int = 4
    num_workers: int = 4


def parse() -> Config:
    cfg = Config()
    p = argparse.ArgumentParser()
    for k, v in asdict(cfg).items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    return Config(**vars(p.parse_args()))


COVS = ["price_idx", "promo", "woy_sin", "woy_cos"]


def load_frames(data_dir):
    files = sorted(glob.glob(os.path.join(data_dir, "*.parquet")))
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    df["woy_sin"] = np.sin(2 * np.pi * df["week"].dt.isocalendar().week.astype(float) / 52.18)
    df["woy_cos"] = np.cos(2 * np.pi * df["week"].dt.isocalendar().week.astype(float) / 52.18)
    df = df.sort_values(["sku", "week"])
    y = np.log1p(df.pivot(index="sku", columns="week", values="units").fillna(0).to_numpy(np.float32))
    covs = np.stack([df.pivot(index="sku", columns="week", values=c).ffill(axis=1).fillna(0).to_numpy(np.float32)
                     for c in COVS], axis=-1)
    return y, covs


class SeqDataset(Dataset):
    def __init__(self, y, covs, mu, sd, cfg, end):
        self.y, self.covs, self.mu, self.sd, self.cfg = y, covs, mu, sd, cfg
        total = cfg.enc_len + cfg.pred_len
        self.items = [(s, t) for s in range(y.shape[0]) for t in range(0, end - total + 1)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, t = self.items[i]
        c = self.cfg
        y = (self.y[s, t:t + c.enc_len + c.pred_len] - self.mu[s]) / self.sd[s]
        cv = self.covs[s, t:t + c.enc_len + c.pred_len]
        return torch.from_numpy(y), torch.from_numpy(cv)


class InformerLite(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        n_in = 1 + len(COVS)
        self.enc_in = nn.Linear(n_in, c.d_model)
        self.dec_in = nn.Linear(n_in, c.d_model)
        self.pos = nn.Embedding(c.enc_len + c.pred_len, c.d_model)
        self.transformer = nn.Transformer(c.d_model, c.n_heads, c.e_layers, c.d_layers,
                                          4 * c.d_model, c.dropout, batch_first=True)
        self.out = nn.Linear(c.d_model, 1)

    def forward(self, y_enc, cov_enc, y_dec, cov_dec):
        c = self.c
        pe = self.pos.weight
        enc = self.enc_in(torch.cat([y_enc.unsqueeze(-1), cov_enc], -1)) + pe[:c.enc_len]
        dec = self.dec_in(torch.cat([y_dec.unsqueeze(-1), cov_dec], -1))
        dec = dec + pe[c.enc_len - c.label_len:c.enc_len + c.pred_len]
        mask = self.transformer.generate_square_subsequent_mask(dec.size(1)).to(dec.device)
        h = self.transformer(enc, dec, tgt_mask=mask)
        return self.out(h[:, -c.pred_len:]).squeeze(-1)


def split_batch(y, cv, c: Config):
    y_enc, cov_enc = y[:, :c.enc_len], cv[:, :c.enc_len]
    # decoder gets the last label_len known values followed by zeros, plus all future covariates
    y_dec = torch.cat([y[:, c.enc_len - c.label_len:c.enc_len],
                       torch.zeros_like(y[:, c.enc_len:])], 1)
    cov_dec = cv[:, c.enc_len - c.label_len:]
    return y_enc, cov_enc, y_dec, cov_dec, y[:, c.enc_len:]


@torch.no_grad()
def backtest(model, y, covs, mu, sd, c: Config, rank, world, device):
    model.eval()
    n, T = y.shape
    abs_err, abs_act = 0.0, 0.0
    series = np.arange(rank, n, world)
    for k in range(c.n_backtest, 0, -1):
        cut = T - k * c.pred_len
        lo = cut - c.enc_len
        for b in range(0, len(series), 2048):
            s = series[b:b + 2048]
            yy = torch.from_numpy((y[s, lo:cut + c.pred_len] - mu[s, None]) / sd[s, None]).to(device)
            cv = torch.from_numpy(covs[s, lo:cut + c.pred_len]).to(device)
            y_enc, cov_enc, y_dec, cov_dec, _ = split_batch(yy, cv, c)
            pred = model(y_enc, cov_enc, y_dec, cov_dec).cpu().numpy() * sd[s, None] + mu[s, None]
            units_pred = np.expm1(np.clip(pred, 0, None))
            units_true = np.expm1(y[s, cut:cut + c.pred_len])
            abs_err += float(np.abs(units_pred - units_true).sum())
            abs_act += float(units_true.sum())
    totals = torch.tensor([abs_err, abs_act], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return totals[0].item() / max(totals[1].item(), 1e-8)


def main():
    cfg = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")
    torch.manual_seed(1234)

    y, covs = load_frames(cfg.data_dir)
    T = y.shape[1]
    train_end = T - cfg.n_backtest * cfg.pred_len
    mu = y[:, :train_end].mean(1)
    sd = np.maximum(y[:, :train_end].std(1), 0.1)
    ds = SeqDataset(y, covs, mu, sd, cfg, train_end)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                    pin_memory=True, drop_last=True)
    log.info("series=%d weeks=%d windows=%d", y.shape[0], T, len(ds))

    model = DistributedDataParallel(InformerLite(cfg).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    loss_fn = nn.HuberLoss(delta=1.0)
    os.makedirs(cfg.ckpt_dir, exist_ok=True)

    best = float("inf")
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        running, steps = 0.0, 0
        for y_b, cv_b in dl:
            y_b, cv_b = y_b.to(device, non_blocking=True), cv_b.to(device, non_blocking=True)
            y_enc, cov_enc, y_dec, cov_dec, target = split_batch(y_b, cv_b, cfg)
            loss = loss_fn(model(y_enc, cov_enc, y_dec, cov_dec), target)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            running += loss.item()
            steps += 1
            if rank == 0 and steps % 200 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, steps, len(dl), running / steps)
        sched.step()

        wape = backtest(model.module, y, covs, mu, sd, cfg, rank, world, device)
        log.info("epoch %d backtest WAPE %.4f lr %.2e", epoch, wape, sched.get_last_lr()[0])
        if rank == 0 and wape < best:
            best = wape
            torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg), "epoch": epoch,
                        "wape": wape, "mu": mu, "sd": sd}, os.path.join(cfg.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
