"""FT-Transformer regression on the property-sales table (log price), RMSE on the full val split.

Multi-node example:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        02_ftt_house_price_rmse.py --train /shared/sales/train.parquet --val /shared/sales/val.parquet \
        --out /shared/runs/ftt_sales
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CAT_COLS = ["zip5", "property_type", "heating", "county", "builder", "sale_type", "condition"]
TARGET = "sale_price"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--d-token", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU, per micro-step")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base-lr", type=float, default=1e-4, help="lr for a global batch of 1024")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--min-count", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class FTTransformer(nn.Module):
    def __init__(self, n_num, cards, d, layers, heads):
        super().__init__()
        self.num_w = nn.Parameter(torch.randn(n_num, d) * 0.02)
        self.num_b = nn.Parameter(torch.zeros(n_num, d))
        self.cat = nn.ModuleList(nn.Embedding(k, d) for k in cards)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        enc = nn.TransformerEncoderLayer(d, heads, 2 * d, 0.1, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(enc, layers, enable_nested_tensor=False)
        self.out = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, xn, xc):
        t = [xn[..., None] * self.num_w + self.num_b]
        t.append(torch.stack([e(xc[:, j]) for j, e in enumerate(self.cat)], 1))
        t = torch.cat(t, 1)
        t = torch.cat([self.cls.expand(len(t), -1, -1), t], 1)
        return self.out(self.blocks(t)[:, 0]).squeeze(-1)


def fit_preprocessing(train_df, num_cols, min_count, seed):
    vocabs = {}
    for c in CAT_COLS:
        vc = train_df[c].astype(str).value_counts()
        kept = sorted(vc[vc >= min_count].index)
        vocabs[c] = {v: i + 1 for i, v in enumerate(kept)}  # 0 = OOV / rare
    qt = QuantileTransformer(n_quantiles=1000, output_distribution="normal", subsample=10**6, random_state=seed)
    qt.fit(train_df[num_cols].fillna(train_df[num_cols].median()).values)
    y = np.log1p(train_df[TARGET].values)
    return {"vocabs": vocabs, "qt": qt, "medians": train_df[num_cols].median(),
            "y_mean": float(y.mean()), "y_std": float(y.std())}


def transform(df, num_cols, prep):
    xn = prep["qt"].transform(df[num_cols].fillna(prep["medians"]).values).astype(np.float32)
    xc = np.stack([df[c].astype(str).map(prep["vocabs"][c]).fillna(0).astype(np.int64).values for c in CAT_COLS], 1)
    y = ((np.log1p(df[TARGET].values) - prep["y_mean"]) / prep["y_std"]).astype(np.float32)
    return TensorDataset(torch.from_numpy(xn), torch.from_numpy(xc), torch.from_numpy(y))


@torch.no_grad()
def gather_rmse(model, ds, rank, world, device, prep, bs=4096):
    """Each rank predicts a contiguous slice; predictions are padded to the same length for all_gather."""
    n = len(ds)
    per = math.ceil(n / world)
    lo, hi = rank * per, min(n, (rank + 1) * per)
    xn, xc, y = (t[lo:hi] for t in ds.tensors)
    model.eval()
    preds = [model(xn[i:i + bs].to(device), xc[i:i + bs].to(device)) for i in range(0, len(xn), bs)]
    local = torch.cat(preds) if preds else torch.empty(0, device=device)
    count = torch.tensor([local.numel()], device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    padded = torch.zeros(per, device=device)
    padded[: local.numel()] = local
    bufs = [torch.zeros(per, device=device) for _ in range(world)]
    dist.all_gather(bufs, padded)
    pred = torch.cat([b[: int(c)] for b, c in zip(bufs, counts)]).cpu().numpy()
    true = ds.tensors[2].numpy()
    # back to log-price units
    err = (pred - true) * prep["y_std"]
    return float(np.sqrt(np.mean(err ** 2)))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    train_df = pd.read_parquet(args.train)
    val_df = pd.read_parquet(args.val)
    num_cols = [c for c in train_df.columns if c not in CAT_COLS + [TARGET]]

    # quantiles are fitted on a subsample; fit once and share so all ranks use identical transforms
    obj = [fit_preprocessing(train_df, num_cols, args.min_count, args.seed) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    prep = obj[0]
    train_ds, val_ds = transform(train_df, num_cols, prep), transform(val_df, num_cols, prep)
    cards = [len(prep["vocabs"][c]) + 1 for c in CAT_COLS]

    model = FTTransformer(len(num_cols), cards, args.d_token, args.layers, args.heads).to(device)
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)
    global_bs = args.batch_size * args.accum * world
    lr = args.base_lr * global_bs / 1024
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=1e-5)

    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=0.1)

    start_epoch, best = 0, float("inf")
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resumed from epoch {ck['epoch']}", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    loss_fn = nn.MSELoss()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for step, (xn, xc, y) in enumerate(loader):
            if step >= steps_per_epoch * args.accum:
                break
            xn, xc, y = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), y.to(device)
            sync_now = (step + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if sync_now else ddp.no_sync()
            with ctx:
                loss = loss_fn(ddp(xn, xc), y) / args.accum
                loss.backward()
            if sync_now:
                nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach() * args.accum * len(y), torch.tensor(float(len(y)), device=device)])

        dist.all_reduce(tot)
        rmse = gather_rmse(model, val_ds, rank, world, device, prep)
        if rank == 0:
            print(f"epoch {epoch} train_mse {tot[0].item() / tot[1].item():.4f} val_rmse_log {rmse:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": min(best, rmse), "prep": prep}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if rmse < best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        best = min(best, rmse)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
