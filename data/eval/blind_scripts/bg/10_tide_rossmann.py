"""TiDE (Das et al. 2023) dense encoder-decoder for Rossmann daily store sales.

Past/future covariates: day of week, promo, state and school holidays.
Static covariates: store type, assortment, log competition distance.
The last 6 weeks are the test period, the 6 weeks before that are validation.

    torchrun --nproc_per_node=4 10_tide_rossmann.py --train data/rossmann/train.csv --store data/rossmann/store.csv
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

HORIZON = 42
LOOKBACK = 84


class ResBlock(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, dropout):
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out), nn.Dropout(dropout))
        self.skip = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x):
        return self.norm(self.dense(x) + self.skip(x))


class TiDE(nn.Module):
    def __init__(self, n_cov, n_static, hidden=256, cov_proj=4, dec_out=16, n_enc=2, n_dec=2, dropout=0.2):
        super().__init__()
        self.cov_proj = ResBlock(n_cov, hidden, cov_proj, dropout)
        d_flat = LOOKBACK + (LOOKBACK + HORIZON) * cov_proj + n_static
        enc = [ResBlock(d_flat, hidden, hidden, dropout)] + [ResBlock(hidden, hidden, hidden, dropout) for _ in range(n_enc - 1)]
        dec = [ResBlock(hidden, hidden, hidden, dropout) for _ in range(n_dec - 1)] + [ResBlock(hidden, hidden, HORIZON * dec_out, dropout)]
        self.encoder = nn.Sequential(*enc)
        self.decoder = nn.Sequential(*dec)
        self.temporal = ResBlock(dec_out + cov_proj, 64, 1, dropout)
        self.lookback_skip = nn.Linear(LOOKBACK, HORIZON)
        self.dec_out = dec_out

    def forward(self, y_past, covs, static):
        # y_past (B, L), covs (B, L + H, C), static (B, S)
        b = y_past.shape[0]
        c = self.cov_proj(covs)
        h = self.encoder(torch.cat([y_past, c.flatten(1), static], dim=1))
        g = self.decoder(h).view(b, HORIZON, self.dec_out)
        out = self.temporal(torch.cat([g, c[:, LOOKBACK:]], dim=-1)).squeeze(-1)
        return out + self.lookback_skip(y_past)


class StoreWindows(Dataset):
    def __init__(self, sales, covs, static, ends):
        self.sales, self.covs, self.static = sales, covs, static
        self.items = [(s, e) for s in range(sales.shape[0]) for e in ends]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        s, e = self.items[k]
        y = self.sales[s, e - HORIZON - LOOKBACK:e]
        return (torch.from_numpy(y[:LOOKBACK]), torch.from_numpy(self.covs[s, e - HORIZON - LOOKBACK:e]),
                torch.from_numpy(self.static[s]), torch.from_numpy(y[LOOKBACK:]), s)


def load(train_csv, store_csv):
    df = pd.read_csv(train_csv, parse_dates=["Date"], dtype={"StateHoliday": str}, low_memory=False)
    st = pd.read_csv(store_csv).set_index("Store").sort_index()
    df = df.sort_values(["Store", "Date"])
    dates = np.sort(df["Date"].unique())
    full = pd.MultiIndex.from_product([st.index, dates], names=["Store", "Date"])
    df = df.set_index(["Store", "Date"]).reindex(full)
    df["Open"] = df["Open"].fillna(0)
    df["Sales"] = df["Sales"].fillna(0)
    df["Promo"] = df["Promo"].fillna(0)
    df["SchoolHoliday"] = df["SchoolHoliday"].fillna(0)
    df["StateHoliday"] = (df["StateHoliday"].fillna("0") != "0").astype(np.float32)
    dow = pd.DatetimeIndex(df.index.get_level_values("Date")).dayofweek / 6.0
    n_s, n_t = len(st), len(dates)
    covs = np.stack([dow, df["Promo"], df["StateHoliday"], df["SchoolHoliday"], df["Open"]], -1)
    covs = covs.reshape(n_s, n_t, -1).astype(np.float32)
    sales = np.log1p(df["Sales"].to_numpy(np.float32)).reshape(n_s, n_t)
    static = np.concatenate([
        pd.get_dummies(st["StoreType"]).to_numpy(np.float32),
        pd.get_dummies(st["Assortment"]).to_numpy(np.float32),
        np.log1p(st["CompetitionDistance"].fillna(st["CompetitionDistance"].median())).to_numpy(np.float32)[:, None] / 10.0,
    ], 1)
    return sales, covs, static, st.index.to_numpy()


def rmspe_per_store(pred_log, true_log, open_mask):
    pred, true = np.expm1(pred_log), np.expm1(true_log)
    m = (true > 0) & (open_mask > 0)
    out = np.full(len(true), np.nan)
    for i in range(len(true)):
        if m[i].any():
            out[i] = np.sqrt(np.mean(((true[i][m[i]] - pred[i][m[i]]) / true[i][m[i]]) ** 2))
    return out


def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(2, device=device)
    preds, trues, opens, sids = [], [], [], []
    with torch.no_grad():
        for y_past, covs, static, y, sid in loader:
            p = net(y_past.to(device), covs.to(device), static.to(device))
            y = y.to(device)
            acc += torch.stack([((p - y) ** 2).sum(), torch.tensor(float(y.numel()), device=device)])
            preds.append(p.cpu().numpy()); trues.append(y.cpu().numpy())
            opens.append(covs[:, LOOKBACK:, 4].numpy()); sids.append(sid.numpy())
    dist.all_reduce(acc)
    net.train()
    local = (np.concatenate(preds), np.concatenate(trues), np.concatenate(opens), np.concatenate(sids))
    return (acc[0] / acc[1]).item(), local


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", default="runs/tide_rossmann")
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--patience", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    sales, covs, static, store_ids = load(args.train, args.store)
    T = sales.shape[1]
    test_end, val_end = T, T - HORIZON
    train_ends = np.arange(LOOKBACK + HORIZON, val_end - HORIZON + 1, 7)
    train_ds = StoreWindows(sales, covs, static, train_ends)
    val_ds = StoreWindows(sales, covs, static, [val_end])
    test_ds = StoreWindows(sales, covs, static, [test_end])

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=512)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=512)

    model = TiDE(covs.shape[-1], static.shape[1]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "tide_best.pt")

    best, stale = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for y_past, c, s, y, _ in loader:
            y_past, c, s, y = (t.to(device, non_blocking=True) for t in (y_past, c, s, y))
            loss = nn.functional.mse_loss(model(y_past, c, s), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        val_mse, _ = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"[{epoch:02d}] train {loss.item():.4f} val log-mse {val_mse:.5f}", flush=True)
        if val_mse < best:
            best, stale = val_mse, 0
            if rank == 0:
                torch.save(model.state_dict(), ckpt)
        else:
            stale += 1
            if stale >= args.patience:
                break
    dist.barrier()

    # fresh model for the held-out weeks
    net = TiDE(covs.shape[-1], static.shape[1]).to(device)
    net.load_state_dict(torch.load(ckpt, map_location=device))
    test_mse, local = evaluate(net, test_loader, device)
    parts = [None] * world
    dist.all_gather_object(parts, local)
    if rank == 0:
        pred, true, opened, sid = (np.concatenate([p[i] for p in parts]) for i in range(4))
        scores = rmspe_per_store(pred, true, opened)
        out = pd.DataFrame({"store": store_ids[sid], "rmspe": scores}).sort_values("store")
        out.to_csv(os.path.join(args.out, "test_rmspe_per_store.csv"), index=False)
        print(f"test log-mse {test_mse:.5f}  mean RMSPE {np.nanmean(scores):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
