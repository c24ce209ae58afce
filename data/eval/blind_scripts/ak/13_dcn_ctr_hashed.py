#!/usr/bin/env python
"""DCN-v2 CTR model on Avazu with hashed categorical features, DDP + bf16.

Raw csv values are hashed with crc32 into one shared table of --buckets rows
(field name salted into the key). Tokenised arrays are cached on shared storage;
rank 0 builds the cache, the others wait for it.

    torchrun --nproc_per_node=4 13_dcn_ctr_hashed.py --csv /shared/avazu/train.csv \
        --cache /shared/avazu/cache --epochs 3
"""
import argparse
import datetime
import os
import time
import zlib

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

FIELDS = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id",
          "app_domain", "app_category", "device_id", "device_ip", "device_model",
          "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19",
          "C20", "C21", "hour_of_day", "weekday"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--buckets", type=int, default=2 ** 22)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--cross-layers", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def stable_hash(field, value, buckets):
    return zlib.crc32(f"{field}={value}".encode()) % buckets


def build_cache(csv_path, cache_dir, buckets):
    df = pd.read_csv(csv_path, dtype=str)
    hour = df["hour"].astype(int)
    df["hour_of_day"] = (hour % 100).astype(str)
    df["weekday"] = (pd.to_datetime(hour // 100, format="%y%m%d").dt.weekday).astype(str)
    ids = np.empty((len(df), len(FIELDS)), dtype=np.int32)
    for j, f in enumerate(FIELDS):
        ids[:, j] = [stable_hash(f, v, buckets) for v in df[f].values]
    label = df["click"].astype(np.float32).values
    day = (hour // 100).values
    os.makedirs(cache_dir, exist_ok=True)
    tmp = os.path.join(cache_dir, f"data.{os.getpid()}.npz")
    np.savez(tmp, ids=ids, label=label, day=day)
    os.replace(tmp, os.path.join(cache_dir, "data.npz"))


class CrossNet(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        self.w = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for lin in self.w:
            x = x0 * lin(x) + x
        return x


class DCNv2(nn.Module):
    def __init__(self, buckets, dim, n_fields, cross_layers):
        super().__init__()
        self.emb = nn.Embedding(buckets, dim)
        nn.init.normal_(self.emb.weight, std=1e-4)
        d = dim * n_fields
        self.cross = CrossNet(d, cross_layers)
        self.deep = nn.Sequential(
            nn.Linear(d, 512), nn.BatchNorm1d(512), nn.ReLU(),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU())
        self.head = nn.Linear(d + 256, 1)

    def forward(self, ids):
        x = self.emb(ids).flatten(1)
        return self.head(torch.cat([self.cross(x), self.deep(x)], 1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    ps, ys = [], []
    for ids, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logit = net(ids.to(device, non_blocking=True).long())
        ps.append(torch.sigmoid(logit.float()).cpu())
        ys.append(y)
    net.train()
    p, y = torch.cat(ps).numpy(), torch.cat(ys).numpy()
    return roc_auc_score(y, p), log_loss(y, p.clip(1e-7, 1 - 1e-7))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run tokenises ~40M rows on rank 0 while the others sit in the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cache_file = os.path.join(args.cache, "data.npz")
    if rank == 0 and not os.path.exists(cache_file):
        t0 = time.time()
        build_cache(args.csv, args.cache, args.buckets)
        print(f"built cache in {time.time() - t0:.0f}s", flush=True)
    dist.barrier()
    z = np.load(cache_file)
    ids, label, day = z["ids"], z["label"], z["day"]
    # last day is the validation set, as in most Avazu setups
    val_mask = day == day.max()
    train_ds = TensorDataset(torch.from_numpy(ids[~val_mask]), torch.from_numpy(label[~val_mask]))
    val_ds = TensorDataset(torch.from_numpy(ids[val_mask]), torch.from_numpy(label[val_mask]))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    # validation runs on rank 0 only, over the whole last day
    val_loader = DataLoader(val_ds, batch_size=32768, num_workers=2, pin_memory=True)

    torch.manual_seed(17)
    model = DCNv2(args.buckets, args.dim, len(FIELDS), args.cross_layers)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    start_epoch = 0
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        seen = 0
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True).long(), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logit = ddp(x)
            loss = F.binary_cross_entropy_with_logits(logit.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += x.size(0)
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{seen * world / (time.time() - t0):.0f} ex/s", flush=True)

        if rank == 0:
            # the unwrapped module in eval mode: SyncBatchNorm uses running stats, no collectives
            auc, ll = evaluate(model, val_loader, device)
            print(f"epoch {epoch} val AUC {auc:.5f} logloss {ll:.5f}", flush=True)
            os.makedirs("ckpt", exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       f"ckpt/dcnv2_epoch{epoch}.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
