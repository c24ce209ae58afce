"""Product-title -> taxonomy leaf classifier (hashed char/word n-grams + MLP), torchrun.

    torchrun --nproc_per_node=8 11_product_taxonomy_hashing.py \
        --train data/catalog_train.parquet --valid data/catalog_valid.parquet --out runs/taxonomy
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.feature_extraction.text import HashingVectorizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("taxonomy")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--out", default="runs/taxonomy")
    p.add_argument("--n_features", type=int, default=2 ** 18)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--accum_steps", type=int, default=2)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min_leaf_count", type=int, default=20)
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


def load_catalog(path):
    df = pd.read_parquet(path, columns=["title", "brand", "taxonomy_path"])
    df = df.dropna(subset=["title", "taxonomy_path"])
    df["text"] = (df["brand"].fillna("") + " " + df["title"]).str.lower().str.strip()
    df["leaf"] = df["taxonomy_path"].str.split(" > ").str[-1].str.strip()
    return df


class HashedTitles(Dataset):
    """Keeps the raw text and hashes lazily, so workers do the vectorizing."""

    def __init__(self, texts, labels, n_features):
        self.texts = list(texts)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.word_vec = HashingVectorizer(n_features=n_features, ngram_range=(1, 2), alternate_sign=False, norm=None)
        self.char_vec = HashingVectorizer(n_features=n_features, analyzer="char_wb", ngram_range=(3, 4),
                                          alternate_sign=False, norm=None)

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]

    def collate(self, batch):
        texts, labels = zip(*batch)
        x = (self.word_vec.transform(texts) + self.char_vec.transform(texts)).tocoo()
        idx = torch.from_numpy(np.vstack([x.row, x.col]).astype(np.int64))
        vals = torch.from_numpy(np.log1p(x.data).astype(np.float32))
        return torch.sparse_coo_tensor(idx, vals, x.shape), torch.tensor(labels)


class SparseMLP(nn.Module):
    def __init__(self, n_features, hidden, n_classes):
        super().__init__()
        self.proj = nn.Linear(n_features, hidden)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(0.25), nn.Linear(hidden, hidden // 2), nn.ReLU(),
                                  nn.Linear(hidden // 2, n_classes))

    def forward(self, x_sparse):
        h = torch.sparse.mm(x_sparse, self.proj.weight.t()) + self.proj.bias
        return self.head(h)


def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            top5 = logits.topk(5, dim=1).indices
            stats[0] += (top5[:, 0] == y).sum()
            stats[1] += (top5 == y[:, None]).any(1).sum()
            stats[2] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return {"top1": (stats[0] / stats[2]).item(), "top5": (stats[1] / stats[2]).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)

    train_df, valid_df = load_catalog(args.train), load_catalog(args.valid)
    leaf_counts = train_df["leaf"].value_counts()
    leaves = sorted(leaf_counts[leaf_counts >= args.min_leaf_count].index)
    leaf2id = {l: i for i, l in enumerate(leaves)}
    train_df = train_df[train_df["leaf"].isin(leaf2id)]
    valid_df = valid_df[valid_df["leaf"].isin(leaf2id)]
    log.info("%d leaves, %d train titles, %d valid titles", len(leaves), len(train_df), len(valid_df))

    train_ds = HashedTitles(train_df["text"], train_df["leaf"].map(leaf2id), args.n_features)
    valid_ds = HashedTitles(valid_df["text"], valid_df["leaf"].map(leaf2id), args.n_features)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=train_ds.collate,
                          num_workers=6, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=1024, sampler=DistributedSampler(valid_ds, shuffle=False),
                          collate_fn=valid_ds.collate, num_workers=4)

    model = DDP(SparseMLP(args.n_features, args.hidden, len(leaves)).to(device), device_ids=[local_rank])
    eff_batch = args.batch_size * args.accum_steps * world
    lr = args.lr * eff_batch / 512
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    log.info("effective batch %d, lr %.2e", eff_batch, lr)

    os.makedirs(args.out, exist_ok=True)
    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, seen = time.time(), 0
        optimizer.zero_grad(set_to_none=True)
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1) / args.accum_steps
            loss.backward()
            if (step + 1) % args.accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            seen += y.numel()
        scheduler.step()

        if is_main:
            metrics = evaluate(model, valid_dl, device)
            log.info("epoch %d | %.0f titles/s/gpu | valid top1 %.4f top5 %.4f", epoch,
                     seen / (time.time() - t0), metrics["top1"], metrics["top5"])
            if metrics["top1"] > best_top1:
                best_top1 = metrics["top1"]
                torch.save({"model": model.module.state_dict(), "leaves": leaves, "n_features": args.n_features,
                            "hidden": args.hidden}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    log.info("best valid top1 %.4f", best_top1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
