#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""
Day-ahead Lastprognose (Netzlast, 15-min Auflösung) mit einem Encoder-Decoder
Transformer (Informer-ähnlich, ohne ProbSparse-Attention).

Start auf dem Institutsrechner (4x A100):

    torchrun --standalone --nproc_per_node=4 08_transformer_load_forecast_wandb.py -c cfg/last_da.yaml
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
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("lastprognose")


class LoadWindows(Dataset):
    """Gleitende Fenster: seq_len Vergangenheit -> pred_len Zukunft (+ Kalendermerkmale)."""

    def __init__(self, df, seq_len, label_len, pred_len, mean, std):
        self.values = ((df["load_mw"].values - mean) / std).astype(np.float32)
        ts = pd.to_datetime(df["timestamp"])
        self.calendar = np.stack([ts.dt.hour / 23.0, ts.dt.dayofweek / 6.0, ts.dt.dayofyear / 365.0,
                                  df["holiday"].values.astype(float)], axis=1).astype(np.float32)
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self):
        return len(self.values) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s, e = i, i + self.seq_len
        d0, d1 = e - self.label_len, e + self.pred_len
        x = np.concatenate([self.values[s:e, None], self.calendar[s:e]], axis=1)
        dec = np.concatenate([self.values[d0:d1, None], self.calendar[d0:d1]], axis=1)
        dec[self.label_len:, 0] = 0.0            # Zukunftswerte ausblenden
        return torch.from_numpy(x), torch.from_numpy(dec), torch.from_numpy(self.values[e:d1].copy())


class LoadTransformer(nn.Module):
    def __init__(self, d_in=5, d_model=256, heads=8, enc_layers=3, dec_layers=2, pred_len=96):
        super().__init__()
        self.enc_emb = nn.Linear(d_in, d_model)
        self.dec_emb = nn.Linear(d_in, d_model)
        self.pos = nn.Parameter(torch.randn(1, 1024, d_model) * 0.02)
        self.tf = nn.Transformer(d_model, heads, enc_layers, dec_layers, 4 * d_model, dropout=0.1, batch_first=True)
        self.out = nn.Linear(d_model, 1)
        self.pred_len = pred_len

    def forward(self, x, dec):
        src = self.enc_emb(x) + self.pos[:, : x.shape[1]]
        tgt = self.dec_emb(dec) + self.pos[:, : dec.shape[1]]
        mask = self.tf.generate_square_subsequent_mask(dec.shape[1]).to(x.device)
        h = self.tf(src, tgt, tgt_mask=mask)
        return self.out(h[:, -self.pred_len:]).squeeze(-1)


def init_tracking(cfg):
    # W&B-Run für Verlauf und Hyperparameter
    return wandb.init(project=cfg["wandb_project"], entity=cfg.get("wandb_entity"),
                      name=cfg["run_name"], id=cfg.get("run_id"), resume="allow", config=cfg)


def make_splits(cfg):
    df = pd.read_parquet(cfg["data"]).sort_values("timestamp").reset_index(drop=True)
    n = len(df)
    tr, va = df.iloc[: int(0.8 * n)], df.iloc[int(0.8 * n) - cfg["seq_len"]:]
    mean, std = tr["load_mw"].mean(), tr["load_mw"].std()
    args = (cfg["seq_len"], cfg["label_len"], cfg["pred_len"], mean, std)
    return LoadWindows(tr, *args), LoadWindows(va, *args), (mean, std)


@torch.no_grad()
def validate(model, loader, std, device):
    model.eval()
    acc = torch.zeros(3, device=device)           # Summe |e|, Summe e^2, Anzahl
    for x, dec, y in loader:
        x, dec, y = x.to(device), dec.to(device), y.to(device)
        err = (model(x, dec) - y) * std
        acc += torch.stack([err.abs().sum(), err.pow(2).sum(), torch.tensor(float(err.numel()), device=device)])
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).sqrt().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [r{rank}] %(message)s")

    run = init_tracking(cfg)

    train_ds, val_ds, (mean, std) = make_splits(cfg)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler, num_workers=4)

    torch.manual_seed(cfg["seed"])
    model = LoadTransformer(pred_len=cfg["pred_len"], d_model=cfg["d_model"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    # Lernrate für die globale Batchgröße skaliert (linear scaling rule)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"] * world)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)
    loss_fn = nn.MSELoss()

    best, bad_epochs = float("inf"), 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, loss_sum = time.time(), torch.zeros(2, device=device)
        for x, dec, y in train_dl:
            x, dec, y = x.to(device, non_blocking=True), dec.to(device, non_blocking=True), y.to(device)
            loss = loss_fn(model(x, dec), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        mae, rmse = validate(model, val_dl, std, device)
        sched.step(mae)                         # identischer Wert auf allen Rängen
        run.log({"epoch": epoch, "train/mse": train_loss, "val/mae_mw": mae, "val/rmse_mw": rmse,
                 "lr": opt.param_groups[0]["lr"]})
        log.info("Epoche %d: train %.4f | MAE %.1f MW | RMSE %.1f MW | %.0fs",
                 epoch, train_loss, mae, rmse, time.time() - t0)

        # Early Stopping: Entscheidung auf Rang 0, an alle verteilt
        stop = torch.zeros(1, device=device)
        if rank == 0:
            if mae < best:
                best, bad_epochs = mae, 0
                os.makedirs(cfg["out_dir"], exist_ok=True)
                torch.save({"model": model.module.state_dict(), "mean": mean, "std": std, "epoch": epoch},
                           os.path.join(cfg["out_dir"], "best.pt"))
            else:
                bad_epochs += 1
            stop[0] = float(bad_epochs >= cfg["patience"])
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            log.info("Early Stopping nach Epoche %d (bestes MAE %.1f MW)", epoch, best)
            break

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
