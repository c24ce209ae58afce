"""GRU encoder-decoder for Wikipedia page views (Kaggle web traffic), per-page SMAPE report.

Series are log1p(views) centred by their own mean over the encoder window;
inputs also carry day-of-week and the value one year earlier.

    torchrun --nproc_per_node=4 16_gru_web_traffic.py --csv data/web_traffic/train_2.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

YEAR = 364


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/web_traffic/train_2.csv")
    p.add_argument("--out", default="runs/gru_web_traffic")
    p.add_argument("--enc-len", type=int, default=280)
    p.add_argument("--horizon", type=int, default=63)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--windows-per-page", type=int, default=4)
    return p.parse_args()


class PageWindows(Dataset):
    def __init__(self, logv, dow, enc_len, horizon, starts):
        self.logv, self.dow = logv, dow
        self.enc_len, self.h = enc_len, horizon
        self.items = starts  # list of (page, forecast_start)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        p, t = self.items[k]
        enc = self.logv[p, t - self.enc_len:t]
        mean = np.nanmean(enc) if np.isfinite(enc).any() else 0.0
        lag_enc = self.logv[p, t - self.enc_len - YEAR:t - YEAR]
        lag_dec = self.logv[p, t - YEAR:t - YEAR + self.h]
        x_enc = np.stack([np.nan_to_num(enc - mean), np.nan_to_num(lag_enc - mean),
                          self.dow[t - self.enc_len:t, 0], self.dow[t - self.enc_len:t, 1]], 1)
        x_dec = np.stack([np.nan_to_num(lag_dec - mean), self.dow[t:t + self.h, 0], self.dow[t:t + self.h, 1]], 1)
        y = self.logv[p, t:t + self.h] - mean
        return (torch.from_numpy(x_enc.astype(np.float32)), torch.from_numpy(x_dec.astype(np.float32)),
                torch.from_numpy(y.astype(np.float32)), torch.tensor(mean, dtype=torch.float32), p)


class GRUSeq2Seq(nn.Module):
    def __init__(self, n_enc, n_dec, hidden):
        super().__init__()
        self.encoder = nn.GRU(n_enc, hidden, batch_first=True)
        self.decoder = nn.GRUCell(n_dec + 1, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x_enc, x_dec):
        _, h = self.encoder(x_enc)
        h = h[0]
        prev = x_enc[:, -1, :1]
        preds = []
        for t in range(x_dec.shape[1]):
            h = self.decoder(torch.cat([x_dec[:, t], prev], 1), h)
            prev = self.out(h)
            preds.append(prev)
        return torch.cat(preds, 1)


def masked_smape_per_row(pred_log, true_log, mean):
    pred = torch.expm1(pred_log + mean[:, None]).clamp_min(0).round()
    true = torch.expm1(true_log + mean[:, None])
    valid = torch.isfinite(true)
    true = torch.nan_to_num(true)
    den = pred.abs() + true.abs()
    s = torch.where(den > 0, 200.0 * (pred - true).abs() / den.clamp_min(1e-8), torch.zeros_like(den))
    s = (s * valid).sum(1) / valid.sum(1).clamp_min(1)
    return s, valid.any(1)


@torch.no_grad()
def per_page_smape(net, loader, device, world):
    net.eval()
    rows = []
    for x_enc, x_dec, y, mean, page in loader:
        x_enc, x_dec, y, mean = x_enc.to(device), x_dec.to(device), y.to(device), mean.to(device)
        s, ok = masked_smape_per_row(net(x_enc, x_dec), y, mean)
        rows.append(torch.stack([page.to(device).float(), s, ok.float()], 1))
    local = torch.cat(rows)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    net.train()
    return torch.cat(gathered).cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    df = pd.read_csv(args.csv)
    pages = df["Page"].to_numpy()
    views = df.drop(columns="Page").to_numpy(np.float32)
    logv = np.log1p(views)  # NaN stays NaN (page did not exist yet)
    dates = pd.to_datetime(df.columns[1:])
    ang = 2 * np.pi * dates.dayofweek.to_numpy() / 7
    dow = np.stack([np.sin(ang), np.cos(ang)], 1).astype(np.float32)

    T = logv.shape[1]
    val_start = T - args.horizon
    rng = np.random.default_rng(0)
    lo, hi = args.enc_len + YEAR, val_start - args.horizon
    train_items = [(p, int(t)) for p in range(len(pages))
                   for t in rng.integers(lo, hi + 1, size=args.windows_per_page)]
    val_items = [(p, val_start) for p in range(len(pages))]
    train_ds = PageWindows(logv, dow, args.enc_len, args.horizon, train_items)
    val_ds = PageWindows(logv, dow, args.enc_len, args.horizon, val_items)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024, num_workers=4)

    net = GRUSeq2Seq(4, 3, args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)  # linear scaling with the global batch
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, bad = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x_enc, x_dec, y, _, _ in loader:
            x_enc, x_dec, y = x_enc.to(device), x_dec.to(device), y.to(device)
            mask = torch.isfinite(y)
            pred = model(x_enc, x_dec)
            # smooth L1 on log scale is a good proxy for SMAPE and keeps gradients bounded
            loss = (nn.functional.smooth_l1_loss(pred, torch.nan_to_num(y), reduction="none") * mask).sum() \
                / mask.sum().clamp_min(1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            opt.step()

        table = per_page_smape(net, val_loader, device, world)
        ok = table[:, 2] > 0
        val_smape = float(table[ok, 1].mean())
        if rank == 0:
            print(f"epoch {epoch} val SMAPE {val_smape:.3f} ({time.time() - t0:.0f}s)", flush=True)
        if val_smape < best:
            best, bad = val_smape, 0
            if rank == 0:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
                pd.DataFrame({"page": pages[table[:, 0].astype(np.int64)], "smape": table[:, 1],
                              "scored": ok}).sort_values("smape").to_csv(
                    os.path.join(args.out, "val_smape_per_page.csv"), index=False)
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
