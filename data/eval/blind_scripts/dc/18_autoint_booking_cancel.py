"""AutoInt (multi-head self-attention over feature embeddings) for hotel-booking cancellation.

torchrun --standalone --nproc_per_node=2 18_autoint_booking_cancel.py \
    --csv /data/hotels/bookings_2015_2024.csv --out runs/autoint_cancel
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
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

TARGET = "is_canceled"
DROP = ["reservation_status", "reservation_status_date", "booking_id"]  # leak the label


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="runs/autoint")
    p.add_argument("--val-from", default="2023-07-01", help="arrival date cut for the validation split")
    p.add_argument("--emb", type=int, default=32)
    p.add_argument("--att-layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class BookingDataset(Dataset):
    def __init__(self, xn, xc, y):
        self.xn, self.xc, self.y = xn, xc, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.xn[i], self.xc[i], self.y[i]


class AutoInt(nn.Module):
    def __init__(self, n_num, cards, emb, layers, heads):
        super().__init__()
        self.num_emb = nn.Parameter(torch.randn(n_num, emb) * 0.01)
        self.cat_emb = nn.ModuleList(nn.Embedding(c, emb) for c in cards)
        self.att = nn.ModuleList(nn.MultiheadAttention(emb, heads, batch_first=True) for _ in range(layers))
        self.res = nn.ModuleList(nn.Linear(emb, emb, bias=False) for _ in range(layers))
        n_fields = n_num + len(cards)
        self.out = nn.Linear(n_fields * emb, 1)

    def forward(self, xn, xc):
        e = torch.cat([xn[..., None] * self.num_emb,
                       torch.stack([m(xc[:, i]) for i, m in enumerate(self.cat_emb)], 1)], 1)
        for att, res in zip(self.att, self.res):
            a, _ = att(e, e, e, need_weights=False)
            e = F.relu(a + res(e))
        return self.out(e.flatten(1)).squeeze(-1)


def prepare(args):
    df = pd.read_csv(args.csv, parse_dates=["arrival_date"])
    df = df.drop(columns=[c for c in DROP if c in df.columns])
    is_val = (df["arrival_date"] >= pd.Timestamp(args.val_from)).values
    df["arrival_month"] = df["arrival_date"].dt.month
    df["arrival_dow"] = df["arrival_date"].dt.dayofweek
    df = df.drop(columns=["arrival_date"])
    y = df.pop(TARGET).values.astype(np.float32)

    cat_cols = [c for c in df.columns if df[c].dtype == object] + ["arrival_month", "arrival_dow"]
    num_cols = [c for c in df.columns if c not in cat_cols]
    cards, xc = [], []
    for c in cat_cols:
        col = df[c].astype(str)
        vocab = pd.Index(np.sort(col[~is_val].unique()))
        cards.append(len(vocab) + 1)
        xc.append(vocab.get_indexer(col) + 1)
    xc = np.stack(xc, 1).astype(np.int64)
    med = df.loc[~is_val, num_cols].median()
    qt = QuantileTransformer(n_quantiles=1000, output_distribution="normal", random_state=args.seed)
    qt.fit(df.loc[~is_val, num_cols].fillna(med).values)
    xn = qt.transform(df[num_cols].fillna(med).values).astype(np.float32)

    tr, va = ~is_val, is_val
    train = BookingDataset(torch.from_numpy(xn[tr]), torch.from_numpy(xc[tr]), torch.from_numpy(y[tr]))
    val = BookingDataset(torch.from_numpy(xn[va]), torch.from_numpy(xc[va]), torch.from_numpy(y[va]))
    return train, val, len(num_cols), cards


@torch.no_grad()
def evaluate(net, ds, rank, world, device):
    net.eval()
    n = len(ds)
    lo, hi = n * rank // world, n * (rank + 1) // world
    out = []
    for i in range(lo, hi, 8192):
        j = slice(i, min(i + 8192, hi))
        out.append(torch.sigmoid(net(ds.xn[j].to(device), ds.xc[j].to(device))).cpu())
    local = torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)
    parts = [None] * world
    dist.all_gather_object(parts, local)
    p = np.concatenate(parts)
    y = ds.y.numpy()
    bce = float(F.binary_cross_entropy(torch.from_numpy(p).clamp(1e-6, 1 - 1e-6), torch.from_numpy(y)))
    return roc_auc_score(y, p), bce


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds, n_num, cards = prepare(args)
    net = AutoInt(n_num, cards, args.emb, args.att_layers, args.heads).to(device)
    model = DDP(net, device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    best, it = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for xn, xc, y in loader:
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xn, xc), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            it += 1
        sched.step()
        dist.all_reduce(run)
        auc, bce = evaluate(net, val_ds, rank, world, device)

        if rank == 0:
            writer.add_scalar("train/bce", (run[0] / run[1]).item(), epoch)
            writer.add_scalar("val/auc", auc, epoch)
            writer.add_scalar("val/bce", bce, epoch)
            print(f"epoch {epoch:2d} train_bce {(run[0] / run[1]).item():.4f} val_auc {auc:.4f} val_bce {bce:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if auc > best:
                best = auc
                torch.save({"model": net.state_dict(), "cards": cards, "n_num": n_num, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
