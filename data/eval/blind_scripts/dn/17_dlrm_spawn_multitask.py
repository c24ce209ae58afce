"""Single-node multi-GPU trainer for the CTR + post-click CVR ranking model.

Started with plain python (the job scheduler only gives us one process per node):

    python 17_dlrm_spawn_multitask.py --data /data/shop/ranking/2024-06 --gpus 8

CVR is only supervised on clicked impressions; a micro-batch on one GPU may
contain no clicks at all, in which case the CVR tower gets no gradient on that
rank for that step.
"""
import argparse
import glob
import os
import socket
import time
from datetime import timedelta

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

CAT_COLS = ["user_id", "item_id", "shop_id", "brand", "category_l1", "category_l2", "channel", "device"]
NUM_COLS = ["price_log", "item_ctr_7d", "shop_score", "user_age"]


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_vocab(df, max_size):
    """Most frequent values per column -> index 1..max_size; everything else -> 0 (OOV)."""
    vocab = {}
    for c in CAT_COLS:
        vc = df[c].astype(str).value_counts()
        vc = vc.sort_index(kind="stable").sort_values(ascending=False, kind="stable")  # deterministic ties
        vocab[c] = {v: i + 1 for i, v in enumerate(vc.index[:max_size])}
    return vocab


class RankingData(Dataset):
    def __init__(self, df, vocab):
        self.cat = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).to_numpy(np.int64) for c in CAT_COLS], 1)
        self.num = df[NUM_COLS].fillna(0).to_numpy(np.float32)
        self.click = df["click"].to_numpy(np.float32)
        self.conv = df["purchase"].to_numpy(np.float32)

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.click[i], self.conv[i]


class RankingModel(nn.Module):
    def __init__(self, vocab_sizes, dim=32):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(n + 1, dim) for n in vocab_sizes])  # +1 for OOV row 0
        self.num_mlp = nn.Sequential(nn.Linear(len(NUM_COLS), 64), nn.BatchNorm1d(64), nn.ReLU(),
                                     nn.Linear(64, dim))
        d = dim * (len(vocab_sizes) + 1)
        self.shared = nn.Sequential(nn.Linear(d, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU())
        self.ctr_tower = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))
        self.cvr_tower = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, cat, num, clicked_mask=None):
        x = torch.cat([e(cat[:, i]) for i, e in enumerate(self.embs)] + [self.num_mlp(num)], 1)
        h = self.shared(x)
        ctr = self.ctr_tower(h).squeeze(1)
        if clicked_mask is None:  # inference: score everything
            return ctr, self.cvr_tower(h).squeeze(1)
        cvr = self.cvr_tower(h[clicked_mask]).squeeze(1) if clicked_mask.any() else None
        return ctr, cvr


@torch.no_grad()
def evaluate(net, loader, device, world):
    net.eval()
    ctr_p, cvr_p, clicks, convs = [], [], [], []
    for cat, num, click, conv in loader:
        ctr, cvr = net(cat.to(device), num.to(device))
        ctr_p.append(torch.sigmoid(ctr).cpu())
        cvr_p.append(torch.sigmoid(cvr).cpu())
        clicks.append(click)
        convs.append(conv)
    net.train()
    local = [torch.cat(t).numpy() for t in (ctr_p, cvr_p, clicks, convs)]
    parts = [None] * world
    dist.all_gather_object(parts, local)
    ctr_p, cvr_p, clicks, convs = (np.concatenate([p[k] for p in parts]) for k in range(4))
    ctr_auc = roc_auc_score(clicks, ctr_p)
    m = clicks > 0
    cvr_auc = float("nan")
    if 0 < convs[m].sum() < m.sum():  # need both classes among the clicked rows
        cvr_auc = roc_auc_score(convs[m], cvr_p[m])
    return ctr_auc, cvr_auc


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(minutes=45))
    device = torch.device("cuda", rank)

    train_df = pd.concat([pd.read_parquet(f) for f in sorted(glob.glob(os.path.join(args.data, "train", "*.parquet")))],
                         ignore_index=True)
    val_df = pd.read_parquet(os.path.join(args.data, "val.parquet"))

    obj = [build_vocab(train_df, args.max_vocab) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    vocab = obj[0]
    train_ds, val_ds = RankingData(train_df, vocab), RankingData(val_df, vocab)
    del train_df, val_df

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)), batch_size=8192, num_workers=2)

    torch.manual_seed(args.seed)
    model = RankingModel([len(vocab[c]) for c in CAT_COLS], args.dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} train={len(train_ds)} val={len(val_ds)}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (cat, num, click, conv) in enumerate(train_dl, 1):
            cat, num = cat.to(device, non_blocking=True), num.to(device, non_blocking=True)
            click, conv = click.to(device, non_blocking=True), conv.to(device, non_blocking=True)
            mask = click > 0
            ctr, cvr = model(cat, num, mask)
            loss = F.binary_cross_entropy_with_logits(ctr, click)
            if cvr is not None:
                loss = loss + args.cvr_weight * F.binary_cross_entropy_with_logits(cvr, conv[mask])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{len(train_dl)} loss {l.item():.5f} "
                          f"{(time.time() - t0) / 200 * 1000:.0f} ms/step", flush=True)
                t0 = time.time()

        ctr_auc, cvr_auc = evaluate(model.module, val_dl, device, world_size)
        if rank == 0:
            print(f"epoch {epoch} val ctr_auc={ctr_auc:.5f} cvr_auc={cvr_auc:.5f}", flush=True)
            torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch},
                       os.path.join(args.out, f"ranker_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="./ranker_runs")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--max_vocab", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch_size", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cvr_weight", type=float, default=1.0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    assert 0 < args.gpus <= torch.cuda.device_count(), f"asked for {args.gpus} GPUs"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
