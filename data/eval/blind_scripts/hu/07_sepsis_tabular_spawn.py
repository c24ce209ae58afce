"""
Early sepsis warning (onset within 6h) from hourly feature snapshots, pooled over
three hospitals. Patient-level split so no patient contributes rows to both train and test.

Single node, one process per visible GPU via mp.spawn:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 07_sepsis_tabular_spawn.py --csv /data/sepsis/snapshots.parquet
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
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupShuffleSplit
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="./sepsis_mlp")
    p.add_argument("--global_batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--split_seed", type=int, default=17)
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def patient_split(df, seed):
    """Deterministic: same seed -> same split in every process."""
    gss = GroupShuffleSplit(n_splits=1, test_size=0.3, random_state=seed)
    tr_idx, rest_idx = next(gss.split(df, groups=df.patient_id))
    rest = df.iloc[rest_idx]
    gss2 = GroupShuffleSplit(n_splits=1, test_size=0.5, random_state=seed + 1)
    va_rel, te_rel = next(gss2.split(rest, groups=rest.patient_id))
    return df.iloc[tr_idx], rest.iloc[va_rel], rest.iloc[te_rel]


def to_tensors(part, feats, mean, std):
    x = ((part[feats].values - mean) / std).astype(np.float32)
    x = np.nan_to_num(x, nan=0.0)
    miss = part[feats].isna().values.astype(np.float32)
    site = part.hospital_id.values.astype(np.int64)
    y = part.sepsis_6h.values.astype(np.float32)
    idx = np.arange(len(part))
    return TensorDataset(torch.from_numpy(np.concatenate([x, miss], 1)), torch.from_numpy(site),
                         torch.from_numpy(y), torch.from_numpy(idx))


class SepsisMLP(nn.Module):
    def __init__(self, d_in, n_sites, hidden):
        super().__init__()
        self.site = nn.Embedding(n_sites, 16)
        self.net = nn.Sequential(
            nn.Linear(d_in + 16, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.3),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.3),
            nn.Linear(hidden, 1),
        )

    def forward(self, x, site):
        return self.net(torch.cat([x, self.site(site)], dim=1)).squeeze(1)


@torch.no_grad()
def score(model, ds, device, rank, world, bs=4096):
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=2)
    model.eval()
    p_all = torch.zeros(len(ds), device=device)
    for x, s, _, idx in loader:
        p_all[idx.to(device)] = torch.sigmoid(model(x.to(device), s.to(device)))
    # every row was scored on some rank; padded repeats carry the same value, so take max
    dist.all_reduce(p_all, op=dist.ReduceOp.MAX)
    return p_all.cpu().numpy()


def worker(local_rank, world_size, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    df = pd.read_parquet(args.csv)
    feats = [c for c in df.columns if c.startswith("f_")]
    tr, va, te = patient_split(df, args.split_seed)
    mean = tr[feats].mean().values
    std = tr[feats].std().replace(0, 1).values
    n_sites = int(df.hospital_id.max()) + 1
    train_ds, val_ds, test_ds = (to_tensors(p, feats, mean, std) for p in (tr, va, te))
    if local_rank == 0:
        print(f"rows train/val/test {len(tr)}/{len(va)}/{len(te)}; patients "
              f"{tr.patient_id.nunique()}/{va.patient_id.nunique()}/{te.patient_id.nunique()}", flush=True)

    per_gpu = args.global_batch // world_size
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.split_seed)
    loader = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = SepsisMLP(2 * len(feats), n_sites, args.hidden)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(loader))
    prev = float(tr.sepsis_6h.mean())
    pos_weight = torch.tensor([(1 - prev) / prev], device=device)

    ckpt = os.path.join(args.out, "best.pt")
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, s, y, _ in loader:
            x, s, y = x.to(device, non_blocking=True), s.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(x, s), y, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        auc = roc_auc_score(va.sepsis_6h.values, score(model, val_ds, device, local_rank, world_size))
        if local_rank == 0:
            print(f"epoch {epoch:02d} val AUROC {auc:.4f}", flush=True)
            if auc > best:
                best = auc
                torch.save({"model": model.module.state_dict(), "mean": mean, "std": std,
                            "feats": feats, "epoch": epoch}, ckpt)
        dist.barrier()

    state = torch.load(ckpt, map_location=device, weights_only=False)
    model.module.load_state_dict(state["model"])
    p_test = score(model, test_ds, device, local_rank, world_size)
    if local_rank == 0:
        y_test = te.sepsis_6h.values
        print(f"test AUROC {roc_auc_score(y_test, p_test):.4f} (best epoch {state['epoch']})")
        for h in sorted(te.hospital_id.unique()):
            m = te.hospital_id.values == h
            if 0 < y_test[m].sum() < m.sum():
                print(f"  hospital {h}: AUROC {roc_auc_score(y_test[m], p_test[m]):.4f} n={m.sum()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    os.makedirs(args.out, exist_ok=True)
    n_gpus = torch.cuda.device_count()
    mp.spawn(worker, args=(n_gpus, args, free_port()), nprocs=n_gpus, join=True)
