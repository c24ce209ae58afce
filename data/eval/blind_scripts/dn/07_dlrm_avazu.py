"""DLRM baseline on Avazu-format click logs (parquet, raw string categoricals).

Categoricals are hashed on the fly with pandas' siphash (stable across
processes and machines), so no vocabulary has to be built or shared.

Launch (2 nodes x 8 GPUs, shared /fsx):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        07_dlrm_avazu.py --data /fsx/avazu/parquet --out /fsx/exp/dlrm_avazu --resume auto
"""
import argparse
import contextlib
import glob
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

CAT_COLS = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
            "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
            "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21"]
logger = logging.getLogger("avazu")


def hash_column(values, buckets):
    return (pd.util.hash_array(values.astype(str)) % np.uint64(buckets)).astype(np.int64)


class AvazuParquet(Dataset):
    def __init__(self, files, buckets):
        df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        hour = pd.to_datetime(df["hour"].astype(str), format="%y%m%d%H")
        dense = np.stack([hour.dt.hour.to_numpy() / 23.0, hour.dt.dayofweek.to_numpy() / 6.0], 1)
        self.dense = dense.astype(np.float32)
        self.sparse = np.stack([hash_column(df[c].to_numpy(), buckets) for c in CAT_COLS], 1)
        self.y = df["click"].to_numpy(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.y[i]


class DLRM(nn.Module):
    def __init__(self, n_tables, buckets, dim=32, n_dense=2):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(buckets, dim) for _ in range(n_tables)])
        self.bottom = nn.Sequential(nn.Linear(n_dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        n = n_tables + 1
        self.register_buffer("tri", torch.triu_indices(n, n, 1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 512), nn.ReLU(),
                                 nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense, sparse):
        d = self.bottom(dense)
        t = torch.stack([d] + [tab(sparse[:, k]) for k, tab in enumerate(self.tables)], 1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([d, z], 1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device):
    # net is the bare module: shards may differ by one batch, so no DDP collectives in here
    net.eval()
    preds, ys = [], []
    for dense, sparse, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = net(dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True))
        preds.append(torch.sigmoid(logit.float()).cpu().numpy())
        ys.append(y.numpy())
    net.train()
    local = (np.concatenate(preds), np.concatenate(ys))
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    p = np.concatenate([e[0] for e in everything])
    y = np.concatenate([e[1] for e in everything])
    return roc_auc_score(y, p), log_loss(y, p, labels=[0, 1])


def save_checkpoint(path, model, opt, epoch, best_auc):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "epoch": epoch, "best_auc": best_auc}, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--buckets", type=int, default=1 << 20)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--global_batch", type=int, default=65536)
    ap.add_argument("--micro_batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    per_rank = args.global_batch // world
    assert per_rank % args.micro_batch == 0, (per_rank, args.micro_batch)
    accum = per_rank // args.micro_batch

    files = sorted(glob.glob(os.path.join(args.data, "*.parquet")))
    n_val = max(1, len(files) // 10)
    train_ds = AvazuParquet(files[:-n_val], args.buckets)  # last day(s) held out
    val_ds = AvazuParquet(files[-n_val:], args.buckets)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, drop_last=True,
                              num_workers=6, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=8192,
                            num_workers=4, pin_memory=True)

    torch.manual_seed(0)
    model = DDP(DLRM(len(CAT_COLS), args.buckets, args.dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch, best_auc = 0, 0.0
    last_path = os.path.join(args.out, "last.pt")
    if args.resume:
        path = last_path if args.resume == "auto" else args.resume
        if os.path.exists(path):
            ckpt = torch.load(path, map_location=device)
            model.module.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            start_epoch, best_auc = ckpt["epoch"] + 1, ckpt["best_auc"]
            logger.info("resumed from %s at epoch %d", path, start_epoch)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0, seen = time.time(), 0
        loss_sum = torch.zeros((), device=device)
        opt.zero_grad(set_to_none=True)
        for i, (dense, sparse, y) in enumerate(train_loader):
            dense, sparse, y = (x.to(device, non_blocking=True) for x in (dense, sparse, y))
            last_micro = (i + 1) % accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logit = model(dense, sparse)
                loss = F.binary_cross_entropy_with_logits(logit.float(), y) / accum
                loss.backward()
            loss_sum += loss.detach()
            if last_micro:
                opt.step()
                opt.zero_grad(set_to_none=True)
                seen += 1
                if seen % 50 == 0:
                    dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
                    logger.info("epoch %d opt-step %d loss %.5f %.0f ex/s", epoch, seen,
                                loss_sum.item() / 50, 50 * args.global_batch / (time.time() - t0))
                    loss_sum.zero_()
                    t0 = time.time()

        auc, ll = evaluate(model.module, val_loader, device)
        logger.info("epoch %d val auc %.5f logloss %.5f", epoch, auc, ll)
        if rank == 0:
            if auc > best_auc:
                best_auc = auc
                save_checkpoint(os.path.join(args.out, "best.pt"), model, opt, epoch, best_auc)
            save_checkpoint(last_path, model, opt, epoch, best_auc)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
