"""Learning-to-rank model for monthly stock selection (ListNet loss).

One sample is one month's cross-section: up to MAX_STOCKS stocks with their
characteristics; the model scores every stock and is trained so that the
softmax of the scores matches the softmax of next-month returns.

    torchrun --nproc_per_node=4 20_cross_sectional_listnet.py --panel /data/monthly_chars.parquet
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

MAX_STOCKS = 3000


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--panel", required=True)
    p.add_argument("--train-end", default="2012-12-31")
    p.add_argument("--val-end", default="2017-12-31")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--months-per-batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--top-frac", type=float, default=0.1)
    p.add_argument("--out", default="runs/listnet")
    return p.parse_args()


class MonthlyCrossSections(Dataset):
    def __init__(self, panel, chars, months):
        self.sections = []
        for m in months:
            g = panel[panel.month == m]
            g = g.sample(n=min(len(g), MAX_STOCKS), random_state=0) if len(g) > MAX_STOCKS else g
            x = np.zeros((MAX_STOCKS, len(chars)), np.float32)
            r = np.zeros(MAX_STOCKS, np.float32)
            mask = np.zeros(MAX_STOCKS, bool)
            n = len(g)
            x[:n] = g[chars].to_numpy(np.float32)
            r[:n] = g["ret_next"].to_numpy(np.float32)
            mask[:n] = True
            self.sections.append((torch.from_numpy(x), torch.from_numpy(r), torch.from_numpy(mask)))

    def __len__(self):
        return len(self.sections)

    def __getitem__(self, i):
        return self.sections[i]


class StockScorer(nn.Module):
    """Per-stock MLP followed by one self-attention layer across the cross-section."""

    def __init__(self, n_chars, d):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(n_chars, d), nn.GELU(), nn.Linear(d, d))
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.score = nn.Linear(d, 1)

    def forward(self, x, mask):
        h = self.embed(x)
        a, _ = self.attn(h, h, h, key_padding_mask=~mask, need_weights=False)
        return self.score(self.norm(h + a)).squeeze(-1)


def listnet_loss(scores, rets, mask, temperature):
    neg = torch.finfo(scores.dtype).min
    p_true = F.softmax(rets.masked_fill(~mask, neg) / temperature, dim=-1)
    log_p = F.log_softmax(scores.masked_fill(~mask, neg), dim=-1)
    return -(p_true * log_p.masked_fill(~mask, 0.0)).sum(-1).mean()


@torch.no_grad()
def long_short(model, loader, device, top_frac):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, r, m in loader:
        x, r, m = x.to(device), r.to(device), m.to(device)
        s = model(x, m).masked_fill(~m, float("nan"))
        for i in range(len(x)):
            valid = m[i]
            k = max(1, int(valid.sum().item() * top_frac))
            order = torch.argsort(s[i][valid], descending=True)
            rv = r[i][valid]
            ls = rv[order[:k]].mean() - rv[order[-k:]].mean()
            acc += torch.stack([ls, ls * ls, torch.ones((), device=device)]).double()
    dist.all_reduce(acc)
    mean = acc[0] / acc[2]
    sd = torch.sqrt(acc[1] / acc[2] - mean ** 2)
    return mean.item(), (mean / sd * np.sqrt(12)).item()


def main():
    args = get_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    panel = pd.read_parquet(args.panel)
    panel["month"] = pd.to_datetime(panel["month"]).dt.to_period("M")
    chars = sorted(c for c in panel.columns if c.startswith("char_"))
    panel[chars] = panel.groupby("month")[chars].rank(pct=True).sub(0.5).fillna(0.0)
    months = sorted(panel.month.unique())
    tr_months = [m for m in months if m <= pd.Period(args.train_end, "M")]
    va_months = [m for m in months if pd.Period(args.train_end, "M") < m <= pd.Period(args.val_end, "M")]
    train_ds = MonthlyCrossSections(panel, chars, tr_months)
    val_ds = MonthlyCrossSections(panel, chars, va_months)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.months_per_batch, sampler=sampler, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, 4, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    model = StockScorer(len(chars), args.d_model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(chars)} characteristics, {len(train_ds)} train months, {len(val_ds)} val months, world={world}")

    best = -np.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, r, m in train_loader:
            x, r, m = x.to(device, non_blocking=True), r.to(device, non_blocking=True), m.to(device, non_blocking=True)
            loss = listnet_loss(model(x, m), r, m, args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)
        ls_mean, ls_sharpe = long_short(model, val_loader, device, args.top_frac)
        if rank == 0:
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} val L/S {ls_mean * 100:.2f}%/mo "
                  f"sharpe {ls_sharpe:.2f} ({time.time() - t0:.0f}s)", flush=True)
            if ls_sharpe > best:
                best = ls_sharpe
                torch.save({"model": model.module.state_dict(), "chars": chars, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
