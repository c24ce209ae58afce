# Wide & Deep CTR model for the app-store recommendation ranking stage.
# Wide part: hashed cross features (user_country x app_category, installed_app x impression_app, ...)
# Deep part: embeddings of the categorical features + normalised numeric features.
#
# run:  torchrun --nproc_per_node=8 11_wide_deep_ctr.py --train_path /data/appstore/train \
#           --eval_path /data/appstore/eval --output_dir /data/appstore/models/wnd

import argparse
import glob
import json
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from tqdm import tqdm

CATEGORICAL = {"user_country": 300, "user_lang": 200, "device_model": 20000, "app_id": 500000,
               "app_category": 100, "app_developer": 80000, "hour_of_day": 24}
NUMERIC = ["user_age", "app_rating", "app_size_mb", "app_installs_log"]
CROSSES = [("user_country", "app_category"), ("device_model", "app_category"), ("user_lang", "app_id")]
WIDE_BUCKETS = 2 ** 22


def cross_hash(a, b, buckets):
    # deterministic integer hash, identical on every process
    x = a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ b.astype(np.uint64)
    return (x % np.uint64(buckets)).astype(np.int64)


class AppImpressions(Dataset):
    def __init__(self, root, num_stats=None):
        df = pd.concat([pd.read_parquet(p) for p in sorted(glob.glob(os.path.join(root, "*.parquet")))],
                       ignore_index=True)
        self.cat = np.stack([df[c].to_numpy(np.int64) % n for c, n in CATEGORICAL.items()], 1)
        num = df[NUMERIC].fillna(0).to_numpy(np.float32)
        if num_stats is None:
            num_stats = {"mean": num.mean(0).tolist(), "std": (num.std(0) + 1e-6).tolist()}
        self.num_stats = num_stats
        self.num = (num - np.array(num_stats["mean"], np.float32)) / np.array(num_stats["std"], np.float32)
        self.wide = np.stack([cross_hash(df[a].to_numpy(), df[b].to_numpy(), WIDE_BUCKETS) for a, b in CROSSES], 1)
        self.label = df["installed"].to_numpy(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.wide[i], self.label[i]


class WideAndDeep(nn.Module):
    def __init__(self, emb_dim=32, hidden=(1024, 512, 256)):
        super().__init__()
        self.wide = nn.EmbeddingBag(WIDE_BUCKETS, 1, mode="sum")
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.embs = nn.ModuleList([nn.Embedding(n, emb_dim) for n in CATEGORICAL.values()])
        d = emb_dim * len(CATEGORICAL) + len(NUMERIC)
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, cat, num, wide):
        deep_in = torch.cat([e(cat[:, i]) for i, e in enumerate(self.embs)] + [num], 1)
        return (self.deep(deep_in).squeeze(1) + self.wide(wide).squeeze(1) + self.wide_bias)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train_path", required=True)
    p.add_argument("--eval_path", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=4096)
    p.add_argument("--wide_lr", type=float, default=0.05)
    p.add_argument("--deep_lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    preds, labels = [], []
    for cat, num, wide, y in loader:
        preds.append(torch.sigmoid(net(cat.to(device), num.to(device), wide.to(device))).cpu().numpy())
        labels.append(y.numpy())
    net.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (np.concatenate(preds), np.concatenate(labels)))
    p = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    return roc_auc_score(y, p), float(np.mean(p) / max(np.mean(y), 1e-9))


def main():
    args = parse()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    train_ds = AppImpressions(args.train_path)
    eval_ds = AppImpressions(args.eval_path, num_stats=train_ds.num_stats)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=8192,
                         num_workers=args.workers)

    torch.manual_seed(2023)
    model = WideAndDeep().to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    wide_params = list(model.module.wide.parameters()) + [model.module.wide_bias]
    deep_params = [p for n, p in model.module.named_parameters() if not n.startswith("wide")]
    opt_wide = torch.optim.Adagrad(wide_params, lr=args.wide_lr)  # FTRL-ish for the wide side
    opt_deep = torch.optim.Adam(deep_params, lr=args.deep_lr)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "num_stats.json"), "w") as f:
            json.dump(train_ds.num_stats, f)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        bar = tqdm(train_dl, disable=rank != 0, desc=f"epoch {epoch}")
        total, n = torch.zeros((), device=device), 0
        for cat, num, wide, y in bar:
            cat, num = cat.to(device, non_blocking=True), num.to(device, non_blocking=True)
            wide, y = wide.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(cat, num, wide), y)
            opt_wide.zero_grad(set_to_none=True)
            opt_deep.zero_grad(set_to_none=True)
            loss.backward()
            opt_wide.step()
            opt_deep.step()
            total += loss.detach()
            n += 1
            if n % 50 == 0:
                bar.set_postfix(loss=f"{(total / n).item():.4f}")
        dist.all_reduce(total, op=dist.ReduceOp.AVG)

        auc, calib = evaluate(model.module, eval_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: train_loss={(total / n).item():.5f} eval_auc={auc:.5f} calibration={calib:.3f}",
                  flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                        "opt_wide": opt_wide.state_dict(), "opt_deep": opt_deep.state_dict()},
                       os.path.join(args.output_dir, f"wnd_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
