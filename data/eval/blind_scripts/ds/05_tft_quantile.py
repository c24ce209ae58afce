"""Temporal Fusion Transformer (reduced) for probabilistic store-department demand.

Inputs per time step: target history (scaled), known future covariates
(promo, price ratio, holiday, day-of-week), static store attributes.
Outputs P10 / P50 / P90 plus a point forecast for the replenishment system.

    torchrun --nproc_per_node=4 05_tft_quantile.py --train_csv data/store_dept_daily.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

QUANTILES = (0.1, 0.5, 0.9)
KNOWN = ["promo", "price_ratio", "holiday", "dow_sin", "dow_cos"]
STATIC = ["store_size", "store_type_a", "store_type_b", "store_type_c"]


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train_csv", default="data/store_dept_daily.csv")
    p.add_argument("--stores_csv", default="data/stores.csv")
    p.add_argument("--save_dir", default="checkpoints/tft")
    p.add_argument("--enc_len", type=int, default=90)
    p.add_argument("--dec_len", type=int, default=28)
    p.add_argument("--hidden", type=int, default=160)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--loss", choices=["quantile", "mse"], default="quantile")
    p.add_argument("--batch_size", type=int, default=256, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--n_origins", type=int, default=4)
    p.add_argument("--num_workers", type=int, default=4)
    return p.parse_args()


def prepare(args):
    df = pd.read_csv(args.train_csv, parse_dates=["date"])
    stores = pd.read_csv(args.stores_csv).set_index("store")
    df = df.sort_values(["store", "dept", "date"])
    df["dow_sin"] = np.sin(2 * np.pi * df["date"].dt.dayofweek / 7)
    df["dow_cos"] = np.cos(2 * np.pi * df["date"].dt.dayofweek / 7)
    idx = ["store", "dept"]
    y = df.pivot_table(index=idx, columns="date", values="sales").fillna(0.0)
    known = np.stack([df.pivot_table(index=idx, columns="date", values=k).reindex(y.index).fillna(0.0)
                      .to_numpy(np.float32) for k in KNOWN], -1)
    store_of = y.index.get_level_values("store")
    static = stores.loc[store_of, STATIC].to_numpy(np.float32)
    return y.to_numpy(np.float32), known, static


class TFTWindows(Dataset):
    def __init__(self, y, known, static, scale, enc, dec, end):
        self.y, self.known, self.static, self.scale = y, known, static, scale
        self.enc, self.dec = enc, dec
        self.idx = [(s, t) for s in range(len(y)) for t in range(0, end - enc - dec + 1, 3)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        s, t = self.idx[i]
        y = self.y[s, t:t + self.enc + self.dec] / self.scale[s]
        k = self.known[s, t:t + self.enc + self.dec]
        return (torch.from_numpy(y[:self.enc]), torch.from_numpy(k), torch.from_numpy(self.static[s]),
                torch.from_numpy(y[self.enc:]))


class GRN(nn.Module):
    def __init__(self, d_in, d_hidden, d_out, dropout, d_ctx=None):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.ctx = nn.Linear(d_ctx, d_hidden, bias=False) if d_ctx else None
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.gate = nn.Linear(d_hidden, 2 * d_out)
        self.skip = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()
        self.norm = nn.LayerNorm(d_out)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, c=None):
        h = self.fc1(x)
        if self.ctx is not None and c is not None:
            h = h + self.ctx(c)
        h = self.drop(self.fc2(F.elu(h)))
        return self.norm(self.skip(x) + F.glu(self.gate(h), dim=-1))


class TFTLite(nn.Module):
    def __init__(self, n_known, n_static, hidden, heads, dropout, dec_len):
        super().__init__()
        self.dec_len = dec_len
        self.static_enc = GRN(n_static, hidden, hidden, dropout)
        self.enc_proj = GRN(1 + n_known, hidden, hidden, dropout, d_ctx=hidden)
        self.dec_proj = GRN(n_known, hidden, hidden, dropout, d_ctx=hidden)
        self.encoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.decoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.post = GRN(hidden, hidden, hidden, dropout)
        self.quantile_head = nn.Linear(hidden, len(QUANTILES))
        self.point_head = nn.Linear(hidden, 1)

    def forward(self, y_hist, known, static):
        enc_len = y_hist.size(1)
        s = self.static_enc(static).unsqueeze(1)
        e_in = self.enc_proj(torch.cat([y_hist.unsqueeze(-1), known[:, :enc_len]], -1), s)
        d_in = self.dec_proj(known[:, enc_len:], s)
        h0 = (s.transpose(0, 1).contiguous(), torch.zeros_like(s.transpose(0, 1)).contiguous())
        e_out, state = self.encoder(e_in, h0)
        d_out, _ = self.decoder(d_in, state)
        seq = torch.cat([e_out, d_out], 1)
        L = seq.size(1)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=seq.device), 1)
        a, _ = self.attn(seq, seq, seq, attn_mask=causal, need_weights=False)
        h = self.post(a[:, -self.dec_len:] + d_out)
        return {"quantiles": self.quantile_head(h), "point": self.point_head(h).squeeze(-1)}


def pinball(pred, y):
    q = torch.tensor(QUANTILES, device=pred.device)
    diff = y.unsqueeze(-1) - pred
    return torch.maximum(q * diff, (q - 1) * diff).mean()


@torch.no_grad()
def evaluate(model, y, known, static, scale, args, rank, world, device):
    model.eval()
    n, T = y.shape
    tot = torch.zeros(4, dtype=torch.float64, device=device)  # abs err, abs y, q-loss, count
    mine = np.arange(rank, n, world)
    for k in range(args.n_origins, 0, -1):
        cut = T - k * args.dec_len
        lo = cut - args.enc_len
        for b in range(0, len(mine), 1024):
            s = mine[b:b + 1024]
            yh = torch.from_numpy(y[s, lo:cut] / scale[s, None]).to(device)
            kn = torch.from_numpy(known[s, lo:cut + args.dec_len]).to(device)
            st = torch.from_numpy(static[s]).to(device)
            out = model(yh, kn, st)
            sc = torch.from_numpy(scale[s, None]).to(device)
            truth = torch.from_numpy(y[s, cut:cut + args.dec_len]).to(device)
            point = out["point"] if args.loss == "mse" else out["quantiles"][..., 1]
            tot[0] += ((point * sc).clamp_min(0) - truth).abs().sum().double()
            tot[1] += truth.abs().sum().double()
            tot[2] += pinball(out["quantiles"], truth / sc).double() * len(s)
            tot[3] += len(s)
    dist.all_reduce(tot)
    model.train()
    return {"wape": (tot[0] / tot[1]).item(), "pinball": (tot[2] / tot[3]).item()}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    y, known, static = prepare(args)
    static = (static - static.mean(0)) / (static.std(0) + 1e-6)
    T = y.shape[1]
    train_end = T - args.n_origins * args.dec_len
    scale = np.maximum(y[:, :train_end].mean(1), 1.0).astype(np.float32)

    ds = TFTWindows(y, known, static, scale, args.enc_len, args.dec_len, train_end)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.num_workers, pin_memory=True, persistent_workers=True)

    model = TFTLite(len(KNOWN), len(STATIC), args.hidden, args.heads, args.dropout, args.dec_len)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"train windows {len(ds)}, steps/epoch {len(loader)}, world {world}")

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (yh, kn, st, target) in enumerate(loader):
            yh, kn, st, target = (t.to(device, non_blocking=True) for t in (yh, kn, st, target))
            out = model(yh, kn, st)
            if args.loss == "quantile":
                loss = pinball(out["quantiles"], target)
            else:
                loss = F.mse_loss(out["point"], target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"  ep {epoch} step {step} loss {loss.item():.4f}", flush=True)

        m = evaluate(model.module, y, known, static, scale, args, rank, world, device)
        plateau.step(m["pinball"])
        if rank == 0:
            print(f"epoch {epoch}: wape {m['wape']:.4f} pinball {m['pinball']:.4f} "
                  f"lr {opt.param_groups[0]['lr']:.1e} ({time.time() - t0:.0f}s)", flush=True)
            if m["pinball"] < best:
                best = m["pinball"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m,
                            "scale": scale, "args": vars(args)}, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
