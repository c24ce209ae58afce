"""Neural Collaborative Filtering (NeuMF) on MovieLens-20M, leave-one-out HR@10 / NDCG@10.

    deepspeed --num_gpus 4 20_ncf_movielens.py --ratings /data/ml-20m/ratings.csv --neg 4
"""
import argparse
import os
import time

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser(description="NeuMF with DeepSpeed")
    parser.add_argument("--ratings", required=True)
    parser.add_argument("--factors", type=int, default=64)
    parser.add_argument("--layers", type=int, nargs="+", default=[256, 256, 128, 64])
    parser.add_argument("--neg", type=int, default=4, help="negatives per positive")
    parser.add_argument("--batch-size", type=int, default=65536)
    parser.add_argument("--lr", type=float, default=4.5e-3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", default="ckpt/neumf")
    return parser.parse_args()


def load_movielens(path):
    df = pd.read_csv(path, usecols=["userId", "movieId", "timestamp"])
    df["user"] = df["userId"].astype("category").cat.codes.astype(np.int64)
    df["item"] = df["movieId"].astype("category").cat.codes.astype(np.int64)
    df = df.sort_values(["user", "timestamp"])
    last = df.groupby("user").tail(1)
    train = df.drop(last.index)
    return train[["user", "item"]].to_numpy(), last[["user", "item"]].to_numpy(), \
        int(df["user"].max()) + 1, int(df["item"].max()) + 1


class NegSampledTrain(Dataset):
    """Positives plus `neg` uniformly sampled negatives each; resampled every epoch."""

    def __init__(self, pairs, n_items, neg, seed):
        self.pairs, self.n_items, self.neg, self.seed = pairs, n_items, neg, seed
        self.resample(0)

    def resample(self, epoch):
        rng = np.random.default_rng(self.seed + epoch)
        n = len(self.pairs)
        neg_users = np.repeat(self.pairs[:, 0], self.neg)
        neg_items = rng.integers(0, self.n_items, size=n * self.neg)
        self.users = np.concatenate([self.pairs[:, 0], neg_users])
        self.items = np.concatenate([self.pairs[:, 1], neg_items])
        self.labels = np.concatenate([np.ones(n, np.float32), np.zeros(n * self.neg, np.float32)])

    def __len__(self):
        return len(self.users)

    def __getitem__(self, i):
        return self.users[i], self.items[i], self.labels[i]


class LeaveOneOut(Dataset):
    """Each test user: the held-out item followed by 100 sampled negatives."""

    def __init__(self, test_pairs, n_items, seed, n_neg=100):
        rng = np.random.default_rng(seed)
        negs = rng.integers(0, n_items, size=(len(test_pairs), n_neg))
        self.users = test_pairs[:, 0]
        self.cands = np.concatenate([test_pairs[:, 1:2], negs], axis=1)

    def __len__(self):
        return len(self.users)

    def __getitem__(self, i):
        return self.users[i], self.cands[i]


class NeuMF(nn.Module):
    def __init__(self, n_users, n_items, factors, layers):
        super().__init__()
        self.gmf_u = nn.Embedding(n_users, factors)
        self.gmf_i = nn.Embedding(n_items, factors)
        self.mlp_u = nn.Embedding(n_users, layers[0] // 2)
        self.mlp_i = nn.Embedding(n_items, layers[0] // 2)
        mlp = []
        for a, b in zip(layers[:-1], layers[1:]):
            mlp += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*mlp)
        self.out = nn.Linear(factors + layers[-1], 1)
        for emb in (self.gmf_u, self.gmf_i, self.mlp_u, self.mlp_i):
            nn.init.normal_(emb.weight, std=0.01)

    def forward(self, users, items):
        gmf = self.gmf_u(users) * self.gmf_i(items)
        mlp = self.mlp(torch.cat([self.mlp_u(users), self.mlp_i(items)], dim=-1))
        return self.out(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


@torch.no_grad()
def hit_ndcg(engine, loader, k):
    engine.eval()
    acc = torch.zeros(3, device=engine.device)
    for users, cands in loader:
        users, cands = users.to(engine.device), cands.to(engine.device)
        scores = engine(users.unsqueeze(1).expand_as(cands), cands).float()
        rank = (scores > scores[:, :1]).sum(1)  # position of the held-out item
        hit = rank < k
        acc[0] += hit.sum()
        acc[1] += (hit.float() / torch.log2(rank.float() + 2)).sum()
        acc[2] += users.numel()
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank = dist.get_rank()

    train_pairs, test_pairs, n_users, n_items = load_movielens(args.ratings)
    train_set = NegSampledTrain(train_pairs, n_items, args.neg, args.seed)
    test_set = LeaveOneOut(test_pairs, n_items, args.seed)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=4096, sampler=DistributedSampler(test_set, shuffle=False))

    model = NeuMF(n_users, n_items, args.factors, args.layers)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "betas": [0.25, 0.5], "eps": 1e-8}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 200,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    loss_fn = nn.BCEWithLogitsLoss()
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{n_users} users, {n_items} items, {len(train_set)} training examples", flush=True)

    best_hr = 0.0
    for epoch in range(args.epochs):
        train_set.resample(epoch)
        sampler.set_epoch(epoch)
        t0 = time.time()
        for users, items, labels in train_loader:
            users = users.to(engine.device, non_blocking=True)
            items = items.to(engine.device, non_blocking=True)
            labels = labels.to(engine.device, non_blocking=True)
            loss = loss_fn(engine(users, items).float(), labels)
            engine.backward(loss)
            engine.step()

        hr, ndcg = hit_ndcg(engine, test_loader, args.topk)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.1f}s) loss {loss.item():.4f} "
                  f"HR@{args.topk} {hr:.4f} NDCG@{args.topk} {ndcg:.4f}", flush=True)

        engine.save_checkpoint(args.ckpt_dir, tag="latest", client_state={"epoch": epoch, "hr": hr})
        if hr > best_hr:
            best_hr = hr
            if rank == 0:
                torch.save({k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                           os.path.join(args.ckpt_dir, "neumf_best.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
