"""DeepAR-style autoregressive LSTM with store / item embeddings.

The sales history is stored as one parquet file per store group
(part-000.parquet ... part-NNN.parquet).  The full panel does not fit in host
memory 8 times over, so each rank only reads its own subset of the files.

    torchrun --nproc_per_node=8 04_deepar_embeddings.py \
        --data /data/m5/parquet --out /checkpoints/deepar_m5
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/m5/parquet")
    ap.add_argument("--out", default="/checkpoints/deepar_m5")
    ap.add_argument("--context", type=int, default=84)
    ap.add_argument("--horizon", type=int, default=28)
    ap.add_argument("--origins", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--emb_store", type=int, default=8)
    ap.add_argument("--emb_item", type=int, default=32)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


def read_shard(files):
    df = pd.concat([pd.read_parquet(f, columns=["store_id", "item_id", "d", "sales", "sell_price",
                                                "snap"]) for f in files])
    df = df.sort_values(["store_id", "item_id", "d"])
    return df


def build_arrays(df, store_vocab, item_vocab):
    sales = df.pivot_table(index=["store_id", "item_id"], columns="d", values="sales").fillna(0)
    price = df.pivot_table(index=["store_id", "item_id"], columns="d", values="sell_price")
    price = price.ffill(axis=1).bfill(axis=1).fillna(0)
    snap = df.pivot_table(index=["store_id", "item_id"], columns="d", values="snap").fillna(0)
    keys = sales.index.to_frame(index=False)
    store_idx = keys["store_id"].map(store_vocab).to_numpy(np.int64)
    item_idx = keys["item_id"].map(item_vocab).to_numpy(np.int64)
    # relative price vs the series' own median price
    rel_price = price.to_numpy(np.float32) / np.maximum(np.median(price.to_numpy(np.float32), 1, keepdims=True), 1e-2)
    covs = np.stack([rel_price, snap.to_numpy(np.float32)], -1)
    return sales.to_numpy(np.float32), covs, store_idx, item_idx


class DeepARWindows(Dataset):
    def __init__(self, y, covs, scale, store_idx, item_idx, context, horizon, end):
        self.y, self.covs, self.scale = y, covs, scale
        self.store_idx, self.item_idx = store_idx, item_idx
        self.L = context + horizon
        self.index = [(s, t) for s in range(len(y)) for t in range(0, end - self.L + 1, 7)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        y = self.y[s, t:t + self.L] / self.scale[s]
        return (torch.from_numpy(y), torch.from_numpy(self.covs[s, t:t + self.L]),
                torch.tensor(self.store_idx[s]), torch.tensor(self.item_idx[s]))


class DeepAR(nn.Module):
    def __init__(self, n_stores, n_items, n_cov, args):
        super().__init__()
        self.store_emb = nn.Embedding(n_stores, args.emb_store)
        self.item_emb = nn.Embedding(n_items, args.emb_item)
        n_in = 1 + n_cov + args.emb_store + args.emb_item
        self.rnn = nn.LSTM(n_in, args.hidden, args.layers, batch_first=True, dropout=0.1)
        self.mu = nn.Linear(args.hidden, 1)
        self.sigma = nn.Linear(args.hidden, 1)

    def forward(self, y_prev, covs, store, item, state=None):
        L = y_prev.size(1)
        e = torch.cat([self.store_emb(store), self.item_emb(item)], -1).unsqueeze(1).expand(-1, L, -1)
        h, state = self.rnn(torch.cat([y_prev.unsqueeze(-1), covs, e], -1), state)
        mu = self.mu(h).squeeze(-1)
        sigma = nn.functional.softplus(self.sigma(h)).squeeze(-1) + 1e-4
        return mu, sigma, state


def gaussian_nll(mu, sigma, y):
    return (torch.log(sigma) + 0.5 * ((y - mu) / sigma) ** 2).mean()


@torch.no_grad()
def forecast(model, y_hist, covs, store, item, horizon):
    """Greedy (mean) rollout for evaluation."""
    mu, _, state = model(y_hist[:, :-1], covs[:, 1:y_hist.size(1)], store, item)
    last = y_hist[:, -1:]
    outs = []
    for h in range(horizon):
        t = y_hist.size(1) + h
        mu, _, state = model(last, covs[:, t:t + 1], store, item, state)
        last = mu.clamp_min(0)
        outs.append(last)
    return torch.cat(outs, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.data, "part-*.parquet")))
    assert len(files) >= world, "need at least one file per rank"
    df = read_shard(files[rank::world])
    store_vocab = {s: i for i, s in enumerate(sorted(df["store_id"].unique()))}
    item_vocab = {s: i for i, s in enumerate(sorted(df["item_id"].unique()))}
    y, covs, store_idx, item_idx = build_arrays(df, store_vocab, item_vocab)
    del df

    T = y.shape[1]
    train_end = T - args.origins * args.horizon
    scale = 1.0 + y[:, :train_end].mean(1)
    ds = DeepARWindows(y, covs, scale, store_idx, item_idx, args.context, args.horizon, train_end)
    # data is already split by file, so a plain shuffling loader per rank
    loader = DataLoader(ds, batch_size=args.batch, shuffle=True, drop_last=True,
                        num_workers=args.workers, pin_memory=True)

    # shards have different sizes: every rank runs the same number of steps
    n_steps = torch.tensor(len(loader), device=device)
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    n_steps = int(n_steps.item())

    model = DeepAR(len(store_vocab), len(item_vocab), covs.shape[-1], args).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * n_steps)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for step, (yb, cb, sb, ib) in zip(range(n_steps), loader):
            yb, cb = yb.to(device, non_blocking=True), cb.to(device, non_blocking=True)
            sb, ib = sb.to(device, non_blocking=True), ib.to(device, non_blocking=True)
            # teacher forcing: predict y[t] from y[t-1] and covariates at t
            mu, sigma, _ = model(yb[:, :-1], cb[:, 1:], sb, ib)
            loss = gaussian_nll(mu, sigma, yb[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        # rolling-origin backtest on this rank's own series, totals summed over ranks
        net = model.module.eval()
        err = torch.zeros(2, dtype=torch.float64, device=device)
        for k in range(args.origins, 0, -1):
            cut = T - k * args.horizon
            for b in range(0, len(y), 1024):
                sl = slice(b, b + 1024)
                hist = torch.from_numpy(y[sl, cut - args.context:cut] / scale[sl, None]).to(device)
                cv = torch.from_numpy(covs[sl, cut - args.context:cut + args.horizon]).to(device)
                st = torch.from_numpy(store_idx[sl]).to(device)
                it = torch.from_numpy(item_idx[sl]).to(device)
                pred = forecast(net, hist, cv, st, it, args.horizon).double()
                pred = pred * torch.from_numpy(scale[sl, None]).to(device)
                true = torch.from_numpy(y[sl, cut:cut + args.horizon]).to(device).double()
                err[0] += (pred - true).abs().sum()
                err[1] += true.abs().sum()
        dist.all_reduce(err)
        if rank == 0:
            print(f"epoch {epoch} nll {(tot[0] / tot[1]).item():.4f} "
                  f"wape {(err[0] / err[1]).item():.4f} time {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "store_vocab": store_vocab,
                        "item_vocab": item_vocab, "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"deepar_e{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
