"""MoA-style multi-label tabular model: entity embeddings + BatchNorm MLP, spawned DDP.

Run on one node (spawns one process per GPU itself):
    python 06_moa_embed_mlp_spawn.py --gpus 4 --data-dir data/moa
"""
import argparse
import os
import socket

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from iterstrat.ml_stratifiers import MultilabelStratifiedKFold
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class MoANet(nn.Module):
    def __init__(self, n_num, n_out, hidden=1024, dropout=0.25, emb_dim=4):
        super().__init__()
        self.emb_type = nn.Embedding(2, emb_dim)      # cp_type
        self.emb_time = nn.Embedding(3, emb_dim)      # cp_time 24/48/72
        self.emb_dose = nn.Embedding(2, emb_dim)      # cp_dose D1/D2
        d_in = n_num + 3 * emb_dim
        self.net = nn.Sequential(
            nn.BatchNorm1d(d_in), nn.Dropout(0.2),
            nn.utils.parametrizations.weight_norm(nn.Linear(d_in, hidden)), nn.BatchNorm1d(hidden), nn.SiLU(),
            nn.Dropout(dropout),
            nn.utils.parametrizations.weight_norm(nn.Linear(hidden, hidden // 2)), nn.BatchNorm1d(hidden // 2), nn.SiLU(),
            nn.Dropout(dropout),
            nn.utils.parametrizations.weight_norm(nn.Linear(hidden // 2, n_out)),
        )

    def forward(self, x_cat, x_num):
        e = torch.cat([self.emb_type(x_cat[:, 0]), self.emb_time(x_cat[:, 1]), self.emb_dose(x_cat[:, 2])], 1)
        return self.net(torch.cat([e, x_num], 1))


def smooth_bce(logits, target, eps=1e-3):
    return F.binary_cross_entropy_with_logits(logits, target * (1 - eps) + 0.5 * eps)


def load_data(data_dir):
    feats = pd.read_csv(os.path.join(data_dir, "train_features.csv"))
    targets = pd.read_csv(os.path.join(data_dir, "train_targets_scored.csv"))
    x_cat = np.stack([
        (feats["cp_type"] == "ctl_vehicle").astype(np.int64),
        feats["cp_time"].map({24: 0, 48: 1, 72: 2}).astype(np.int64),
        (feats["cp_dose"] == "D2").astype(np.int64),
    ], 1)
    num_cols = [c for c in feats.columns if c.startswith(("g-", "c-"))]
    return x_cat, feats[num_cols].values.astype(np.float32), targets.drop(columns="sig_id").values.astype(np.float32)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    x_cat, x_num, y = load_data(args.data_dir)
    mskf = MultilabelStratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    oof = np.zeros_like(y)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    for fold, (tr_idx, va_idx) in enumerate(mskf.split(x_num, y)):
        qt = QuantileTransformer(n_quantiles=100, output_distribution="normal", random_state=args.seed)
        num_tr = qt.fit_transform(x_num[tr_idx]).astype(np.float32)
        num_va = qt.transform(x_num[va_idx]).astype(np.float32)
        tr_ds = TensorDataset(torch.from_numpy(x_cat[tr_idx]), torch.from_numpy(num_tr), torch.from_numpy(y[tr_idx]))

        sampler = DistributedSampler(tr_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        # drop_last keeps every per-GPU BatchNorm batch full size
        loader = DataLoader(tr_ds, batch_size=args.batch_size // world_size, sampler=sampler,
                            num_workers=2, pin_memory=True, drop_last=True)

        net = MoANet(x_num.shape[1], y.shape[1], args.hidden, args.dropout).to(device)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        model = DDP(net, device_ids=[rank], output_device=rank)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * 10, epochs=args.epochs,
                                                    steps_per_epoch=len(loader), pct_start=0.1, div_factor=1e3)

        mine = np.arange(len(va_idx))[rank::world_size]
        xc_va = torch.from_numpy(x_cat[va_idx][mine]).to(device)
        xn_va = torch.from_numpy(num_va[mine]).to(device)
        y_va = torch.from_numpy(y[va_idx][mine]).to(device)

        best, bad = float("inf"), 0
        ckpt = os.path.join(args.out_dir, f"fold{fold}.pt")
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for xc, xn, yb in loader:
                xc, xn, yb = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                loss = smooth_bce(model(xc, xn), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

            model.module.eval()
            with torch.no_grad():
                logits = model.module(xc_va, xn_va)
                # sum of per-sample losses and the sample count, so the reduce is exact with uneven shards
                stats = torch.stack([
                    F.binary_cross_entropy_with_logits(logits, y_va, reduction="none").mean(1).sum(),
                    torch.tensor(float(len(mine)), device=device)])
            dist.all_reduce(stats)
            val_loss = (stats[0] / stats[1]).item()
            if rank == 0:
                print(f"fold {fold} epoch {epoch:02d} train {loss.item():.5f} valid {val_loss:.5f}", flush=True)
            if val_loss < best - 1e-5:
                best, bad = val_loss, 0
                if rank == 0:
                    torch.save(model.module.state_dict(), ckpt)
            else:
                bad += 1
            if bad >= args.patience:   # val_loss is all-reduced, so every rank stops at the same epoch
                break

        dist.barrier()
        net.load_state_dict(torch.load(ckpt, map_location=device))
        net.eval()
        with torch.no_grad():
            p = torch.sigmoid(net(xc_va, xn_va)).cpu().numpy()
        parts = [None] * world_size
        dist.all_gather_object(parts, (mine, p))
        for m, q in parts:
            oof[va_idx[m]] = q
        if rank == 0:
            print(f"fold {fold} best valid {best:.5f}", flush=True)

    if rank == 0:
        eps = 1e-15
        o = np.clip(oof, eps, 1 - eps)
        cv = -np.mean(y * np.log(o) + (1 - y) * np.log(1 - o))
        print(f"CV log loss {cv:.6f}")
        np.save(os.path.join(args.out_dir, "oof.npy"), oof)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="data/moa")
    ap.add_argument("--out-dir", default="runs/moa_mlp")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--folds", type=int, default=7)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--batch-size", type=int, default=512, help="global batch, split across GPUs")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dropout", type=float, default=0.25)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    args.port = free_port()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
