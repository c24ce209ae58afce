"""DCN-v2 ranking model on raw (string-valued) ad-request logs.

Vocabularies are built once from the training parquet by rank 0 (values seen
at least --min_count times), written next to the run, and read by all ranks.
Rare and unseen values share one OOV row per feature.

    torchrun --nproc_per_node=8 12_dcn_v2_ctr.py --data /nfs/ads/requests_0601_0614 \
        --run /nfs/ads/runs/dcnv2_0614
"""
import argparse
import json
import logging
import os
import time
from datetime import timedelta

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

CAT_FEATURES = ["publisher", "placement", "ad_format", "advertiser", "creative", "os_version",
                "browser", "region", "carrier", "page_category"]
NUM_FEATURES = ["floor_price", "user_freq_1d", "user_freq_7d", "viewability"]
logger = logging.getLogger("dcnv2")


def build_vocab(df, min_count):
    vocab = {}
    for col in CAT_FEATURES:
        counts = df[col].astype(str).value_counts()
        kept = sorted(counts.index[counts >= min_count])
        vocab[col] = {v: i for i, v in enumerate(kept)}
    return vocab


def encode(df, vocab):
    cols = []
    for col in CAT_FEATURES:
        m = vocab[col]
        oov = len(m)
        cols.append(np.fromiter((m.get(v, oov) for v in df[col].astype(str)), dtype=np.int64, count=len(df)))
    return np.stack(cols, 1)


class RequestLog(Dataset):
    def __init__(self, df, vocab):
        self.x_cat = encode(df, vocab)
        self.x_num = np.log1p(df[NUM_FEATURES].fillna(0).clip(lower=0).to_numpy(np.float32))
        self.y = df["clicked"].to_numpy(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x_cat[i], self.x_num[i], self.y[i]


class CrossLayerV2(nn.Module):
    def __init__(self, d, rank=None):
        super().__init__()
        if rank:  # low-rank (mixture-free) variant
            self.U = nn.Linear(d, rank, bias=False)
            self.V = nn.Linear(rank, d)
        else:
            self.U, self.V = None, nn.Linear(d, d)

    def forward(self, x0, x):
        h = self.V(self.U(x)) if self.U is not None else self.V(x)
        return x0 * h + x


class DCNv2(nn.Module):
    def __init__(self, vocab_sizes, n_num, dim=16, n_cross=3, low_rank=64, deep=(512, 256)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(n, dim) for n in vocab_sizes])
        d = dim * len(vocab_sizes) + n_num
        self.cross = nn.ModuleList([CrossLayerV2(d, low_rank) for _ in range(n_cross)])
        layers, h_in = [], d
        for h in deep:
            layers += [nn.Linear(h_in, h), nn.ReLU()]
            h_in = h
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(d + h_in, 1)

    def forward(self, x_cat, x_num):
        x0 = torch.cat([e(x_cat[:, i]) for i, e in enumerate(self.embs)] + [x_num], 1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.out(torch.cat([x, self.deep(x0)], 1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    p, y = [], []
    for xc, xn, yy in loader:
        p.append(torch.sigmoid(net(xc.to(device), xn.to(device))).cpu().numpy())
        y.append(yy.numpy())
    net.train()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(p), np.concatenate(y)))
    preds = np.concatenate([a for a, _ in parts])
    labels = np.concatenate([b for _, b in parts])
    return roc_auc_score(labels, preds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--min_count", type=int, default=20)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=60))  # rank 0 builds the vocab first
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_df = pd.read_parquet(os.path.join(args.data, "train"))
    val_df = pd.read_parquet(os.path.join(args.data, "val"))

    vocab_path = os.path.join(args.run, "vocab.json")
    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
        vocab = build_vocab(train_df, args.min_count)
        with open(vocab_path + ".tmp", "w") as f:
            json.dump(vocab, f)
        os.replace(vocab_path + ".tmp", vocab_path)
    dist.barrier()
    with open(vocab_path) as f:
        vocab = json.load(f)
    vocab_sizes = [len(vocab[c]) for c in CAT_FEATURES]
    logger.info("vocab sizes: %s", dict(zip(CAT_FEATURES, vocab_sizes)))

    train_ds, val_ds = RequestLog(train_df, vocab), RequestLog(val_df, vocab)
    del train_df, val_df
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=16384, num_workers=4)

    torch.manual_seed(0)
    model = DDP(DCNv2(vocab_sizes, len(NUM_FEATURES), args.dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (xc, xn, y) in enumerate(train_dl, 1):
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xc, xn), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 200 == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.5f (%.1fs)", epoch, step, len(train_dl), lt.item(),
                            time.time() - t0)
        auc = evaluate(model.module, val_dl, device)
        logger.info("epoch %d val AUC %.5f", epoch, auc)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "vocab_sizes": vocab_sizes, "epoch": epoch,
                        "auc": auc}, os.path.join(args.run, f"dcnv2_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
