"""Walk-forward retraining of a cross-sectional return model.

For every rebalance window a fresh model is trained on the trailing `train_years`
of data (with an embargo before the test period) and used to score the next
`test_months`. Out-of-sample predictions are stitched together into one file.

Launch:
    torchrun --nproc_per_node=8 02_walkforward_equity_mlp.py --panel /data/us_equity/panel.parquet
"""
import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Window:
    train_start: pd.Timestamp
    train_end: pd.Timestamp
    test_start: pd.Timestamp
    test_end: pd.Timestamp

    @property
    def tag(self):
        return self.test_start.strftime("%Y%m")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--panel", required=True)
    ap.add_argument("--target", default="fwd_ret_21d")
    ap.add_argument("--first-test", default="2012-01-01")
    ap.add_argument("--last-test", default="2023-12-31")
    ap.add_argument("--train-years", type=int, default=5)
    ap.add_argument("--test-months", type=int, default=3)
    ap.add_argument("--embargo-days", type=int, default=21)
    ap.add_argument("--global-batch", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out-dir", default="/mnt/shared/wf_mlp")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def make_windows(args):
    windows = []
    t = pd.Timestamp(args.first_test)
    last = pd.Timestamp(args.last_test)
    while t <= last:
        test_end = t + pd.DateOffset(months=args.test_months)
        train_end = t - pd.Timedelta(days=args.embargo_days)
        windows.append(Window(t - pd.DateOffset(years=args.train_years), train_end, t, test_end))
        t = test_end
    return windows


class ReturnMLP(nn.Module):
    def __init__(self, n_in, hidden, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, hidden), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)


def rank_gauss(df, cols):
    # cross-sectional rank transform per date, robust to fat tails
    ranked = df.groupby("date")[cols].rank(pct=True)
    return (ranked - 0.5).fillna(0.0).astype(np.float32)


def gather_variable(t, world_size):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    max_n = max(sizes)
    padded = torch.zeros((max_n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


def train_window(args, win, panel, feats, device, rank, world_size, local_rank):
    tr = panel[(panel.date >= win.train_start) & (panel.date < win.train_end)]
    te = panel[(panel.date >= win.test_start) & (panel.date < win.test_end)]
    x_tr = torch.from_numpy(rank_gauss(tr, feats).values)
    y_tr = torch.from_numpy(tr.groupby("date")[args.target].rank(pct=True).sub(0.5).values.astype(np.float32))
    train_ds = TensorDataset(x_tr, y_tr)

    per_gpu = args.global_batch // world_size
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    torch.manual_seed(args.seed)  # same init on all ranks; DDP broadcasts anyway
    model = DDP(ReturnMLP(len(feats), args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = loss_fn(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * len(yb), torch.tensor(float(len(yb)), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"[{win.tag}] epoch {epoch} train_mse {(tot[0] / tot[1]).item():.5f}", flush=True)

    # out-of-sample scoring: disjoint strided shards, no padding, then stitched back together
    x_te = torch.from_numpy(rank_gauss(te, feats).values)
    idx = torch.arange(rank, len(te), world_size)
    net = model.module.eval()
    preds = []
    with torch.no_grad():
        for chunk in idx.split(65536):
            preds.append(net(x_te[chunk].to(device)))
    local_pred = torch.cat(preds) if preds else torch.zeros(0, device=device)
    all_idx = gather_variable(idx.to(device), world_size)
    all_pred = gather_variable(local_pred, world_size)
    return model, all_idx.cpu().numpy(), all_pred.cpu().numpy(), te


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    panel = pd.read_parquet(args.panel)
    panel["date"] = pd.to_datetime(panel["date"])
    panel = panel.sort_values(["date", "ticker"]).reset_index(drop=True)
    feats = sorted(c for c in panel.columns if c.startswith("f_"))
    if rank == 0:
        os.makedirs(os.path.join(args.out_dir, "preds"), exist_ok=True)
        os.makedirs(os.path.join(args.out_dir, "models"), exist_ok=True)
    dist.barrier()

    for win in make_windows(args):
        pred_path = os.path.join(args.out_dir, "preds", f"{win.tag}.parquet")
        # rank 0 decides what is already done so every rank skips the same windows
        flag = [os.path.exists(pred_path) if rank == 0 else None]
        dist.broadcast_object_list(flag, src=0)
        if flag[0]:
            continue

        t0 = time.time()
        model, idx, pred, te = train_window(args, win, panel, feats, device, rank, world_size, local_rank)
        if rank == 0:
            order = np.argsort(idx)
            out = te[["date", "ticker", args.target]].copy()
            out["pred"] = pred[order]
            ic = out.groupby("date").apply(lambda g: g["pred"].corr(g[args.target], method="spearman")).mean()
            out.to_parquet(pred_path)
            torch.save({"model": model.module.state_dict(), "features": feats, "window": vars(win)},
                       os.path.join(args.out_dir, "models", f"{win.tag}.pt"))
            print(f"[{win.tag}] n_test={len(out)} mean_rank_ic={ic:.4f} ({time.time() - t0:.0f}s)", flush=True)
        del model
        torch.cuda.empty_cache()
        dist.barrier()

    if rank == 0:
        parts = sorted(os.listdir(os.path.join(args.out_dir, "preds")))
        oos = pd.concat([pd.read_parquet(os.path.join(args.out_dir, "preds", p)) for p in parts])
        oos.to_parquet(os.path.join(args.out_dir, "oos_predictions.parquet"))
        print(f"wrote {len(oos)} out-of-sample rows from {len(parts)} windows")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
