"""Criteo CTR subset: FT-Transformer with an auxiliary count-reconstruction head,
multi-seed bagging over fixed folds, two nodes x 4 GPUs.

    # on each node (shared /mnt/nfs for cache and outputs)
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 \
        20_criteo_ftt_multiseed.py --raw /mnt/nfs/criteo/day_0_10M.tsv --cache /mnt/nfs/cache/criteo_10M
"""
import argparse
import datetime
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

INT_COLS = [f"I{i}" for i in range(1, 14)]
CAT_COLS = [f"C{i}" for i in range(1, 27)]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--raw", required=True)
    p.add_argument("--cache", required=True, help="directory on storage shared by all nodes")
    p.add_argument("--out", default="/mnt/nfs/runs/criteo_ftt")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--folds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--aux-epochs", type=int, default=1, help="epochs with the auxiliary loss switched on")
    p.add_argument("--batch-size", type=int, default=2048, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for the full 8-GPU batch")
    p.add_argument("--min-count", type=int, default=20)
    return p.parse_args()


def build_cache(raw, cache, min_count):
    df = pd.read_csv(raw, sep="\t", header=None, names=["label"] + INT_COLS + CAT_COLS)
    for c in INT_COLS:
        v = df[c].fillna(-1).clip(lower=-1)
        df[c] = np.log1p(v + 1).astype(np.float32)
    for c in CAT_COLS:
        vc = df[c].value_counts()
        keep = np.sort(vc[vc >= min_count].index.values.astype(str))
        df[c] = df[c].astype(str).map({v: i + 1 for i, v in enumerate(keep)}).fillna(0).astype(np.int64)
    os.makedirs(cache, exist_ok=True)
    tmp = os.path.join(cache, "data.parquet.tmp")
    df.to_parquet(tmp)
    os.replace(tmp, os.path.join(cache, "data.parquet"))


class FTT(nn.Module):
    def __init__(self, n_num, cards, d=32, depth=2, heads=4, drop=0.1):
        super().__init__()
        self.nw = nn.Parameter(torch.randn(n_num, d) * d ** -0.5)
        self.nb = nn.Parameter(torch.zeros(n_num, d))
        self.emb = nn.Embedding(int(sum(cards)), d)
        self.register_buffer("off", torch.tensor(np.r_[0, np.cumsum(cards)[:-1]], dtype=torch.long))
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, drop, activation="gelu", batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, 1))
        self.aux_head = nn.Linear(d, 1)   # reconstructs each numeric value from its contextual token

    def forward(self, x_num, x_cat, with_aux=False):
        h = torch.cat([self.cls.expand(len(x_num), -1, -1), x_num.unsqueeze(-1) * self.nw + self.nb,
                       self.emb(x_cat + self.off)], 1)
        h = self.enc(h)
        logit = self.head(h[:, 0]).squeeze(-1)
        if with_aux:
            return logit, self.aux_head(h[:, 1:1 + x_num.size(1)]).squeeze(-1)
        return logit


@torch.no_grad()
def predict(model, ds, device):
    model.eval()
    out = [torch.sigmoid(model(xn.to(device), xc.to(device))) for xn, xc, _ in DataLoader(ds, batch_size=32768)]
    return torch.cat(out) if out else torch.zeros(0, device=device)


def all_gather_varlen(t):
    """all_gather for 1-D CUDA tensors whose length differs between ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    bufs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return torch.cat([b[: int(s.item())] for b, s in zip(bufs, sizes)])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while building the parquet cache before the first barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        if not os.path.exists(os.path.join(args.cache, "data.parquet")):
            build_cache(args.raw, args.cache, args.min_count)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    df = pd.read_parquet(os.path.join(args.cache, "data.parquet"))
    cards = [int(df[c].max()) + 1 for c in CAT_COLS]
    x_num = torch.from_numpy(df[INT_COLS].values.astype(np.float32))
    x_cat = torch.from_numpy(df[CAT_COLS].values.astype(np.int64))
    y = df["label"].values.astype(np.float32)
    full = TensorDataset(x_num, x_cat, torch.from_numpy(y))
    folds = list(StratifiedKFold(args.folds, shuffle=True, random_state=2023).split(np.zeros(len(y)), y))
    oof = np.zeros(len(y), np.float32)

    for seed in args.seeds:
        for fold, (tr_idx, va_idx) in enumerate(folds):
            torch.manual_seed(seed * 100 + fold)
            tr_ds = Subset(full, tr_idx)
            sampler = DistributedSampler(tr_ds, shuffle=True, seed=seed, drop_last=True)
            loader = DataLoader(tr_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                                pin_memory=True, drop_last=True)
            # aux_head only takes part in the first --aux-epochs epochs, hence find_unused_parameters
            model = DDP(FTT(len(INT_COLS), cards).to(device), device_ids=[local_rank], find_unused_parameters=True)
            lr = args.lr * world / 8
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-6)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

            mine = va_idx[rank::world]
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                model.train()
                t0, use_aux = time.time(), epoch < args.aux_epochs
                for xn, xc, yb in loader:
                    xn, xc, yb = xn.to(device, non_blocking=True), xc.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                    if use_aux:
                        logit, rec = model(xn, xc, with_aux=True)
                        loss = F.binary_cross_entropy_with_logits(logit, yb) + 0.1 * F.mse_loss(rec, xn)
                    else:
                        loss = F.binary_cross_entropy_with_logits(model(xn, xc), yb)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                p = all_gather_varlen(predict(model.module, Subset(full, mine), device)).cpu().numpy()
                rows = np.concatenate([va_idx[r::world] for r in range(world)])
                auc = roc_auc_score(y[rows], p)
                if rank == 0:
                    print(f"seed {seed} fold {fold} epoch {epoch} auc {auc:.5f} logloss "
                          f"{log_loss(y[rows], p):.5f} ({time.time() - t0:.0f}s)", flush=True)
            oof[rows] += p / len(args.seeds)
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, f"seed{seed}_fold{fold}.pt"))
            del model, opt

    if rank == 0:
        print(f"bagged OOF auc {roc_auc_score(y, oof):.5f} logloss {log_loss(y, oof):.5f}")
        np.save(os.path.join(args.out, "oof.npy"), oof)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
