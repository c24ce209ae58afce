"""MLP baseline on HIGGS (11M rows, 28 dense features), OneCycle schedule.

Single-GPU reference run: 0.842 AUC with the defaults below.
Scaled out with:
    torchrun --standalone --nproc_per_node=8 06_mlp_higgs_onecycle.py --csv /data/higgs/HIGGS.csv.gz
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/data/higgs/HIGGS.csv.gz")
    p.add_argument("--n-val", type=int, default=500_000, help="last rows are the official test split")
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024, 512, 256])
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--max-lr", type=float, default=3e-3)
    p.add_argument("--pct-start", type=float, default=0.25)
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--logdir", default="runs/higgs_mlp")
    return p.parse_args()


def make_mlp(d_in, hidden, dropout):
    layers = []
    for h in hidden:
        layers += [nn.Linear(d_in, h), nn.SiLU(), nn.Dropout(dropout)]
        d_in = h
    layers.append(nn.Linear(d_in, 1))
    return nn.Sequential(*layers)


def load(args):
    cols = ["label"] + [f"f{i}" for i in range(28)]
    df = pd.read_csv(args.csv, header=None, names=cols, dtype=np.float32)
    tr, va = df.iloc[: -args.n_val], df.iloc[-args.n_val:]
    feats = cols[1:]
    scaler = StandardScaler().fit(tr[feats].values)
    to_ds = lambda d: TensorDataset(torch.from_numpy(scaler.transform(d[feats].values).astype(np.float32)),
                                    torch.from_numpy(d["label"].values))
    return to_ds(tr), to_ds(va)


@torch.no_grad()
def eval_auc(model, val_ds, rank, world, device):
    model.eval()
    X, y = val_ds.tensors
    n = len(y)
    chunk = math.ceil(n / world)
    lo, hi = rank * chunk, min(n, (rank + 1) * chunk)
    scores = torch.cat([torch.sigmoid(model(X[i:min(i + 65536, hi)].to(device)).squeeze(-1)).cpu()
                        for i in range(lo, hi, 65536)])
    parts = [None] * world
    dist.all_gather_object(parts, scores.numpy())
    s = np.concatenate(parts)
    return roc_auc_score(y.numpy(), s)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds, val_ds = load(args)
    model = make_mlp(28, args.hidden, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.max_lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(train_ds) // args.batch_size
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.max_lr, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
        pct_start=args.pct_start, div_factor=25.0, final_div_factor=1e3,
    )

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    best_auc, gstep = 0.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for X, y in loader:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(X).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            gstep += 1
            if writer is not None and gstep % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), gstep)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], gstep)

        auc = eval_auc(model.module, val_ds, rank, world, device)
        if rank == 0:
            writer.add_scalar("val/auc", auc, epoch)
            print(f"epoch {epoch} val_auc {auc:.5f} lr {sched.get_last_lr()[0]:.2e} "
                  f"time {time.time() - t0:.0f}s", flush=True)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.logdir, "best_mlp.pt"))

    if rank == 0:
        writer.add_hparams({"max_lr": args.max_lr, "batch_size": args.batch_size, "epochs": args.epochs},
                           {"hparam/best_auc": best_auc})
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
