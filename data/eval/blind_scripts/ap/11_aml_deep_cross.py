"""AML alert scoring: Deep & Cross Network on account-month aggregates.

One row per (account, month) with aggregated wire / cash / card activity, KYC attributes
and the label "sar_filed" (suspicious activity report within 90 days).

    torchrun --nnodes=1 --nproc_per_node=8 11_aml_deep_cross.py --data /mnt/aml/account_month.parquet
"""
import argparse
import json
import os
import time

import joblib
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.preprocessing import PowerTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

KYC_CATS = ["customer_type", "industry_code", "country_risk", "onboarding_channel", "pep_flag", "segment"]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="/mnt/aml/account_month.parquet")
    parser.add_argument("--train-until", default="2023-06")
    parser.add_argument("--test-from", default="2023-09")  # 3 month gap for label maturity
    parser.add_argument("--cross-layers", type=int, default=3)
    parser.add_argument("--deep", type=int, nargs="+", default=[512, 256, 128])
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--output-dir", default="artifacts/aml_dcn")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class CrossLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Linear(d, d)

    def forward(self, x0, x):
        return x0 * self.w(x) + x


class DCN(nn.Module):
    def __init__(self, cards, n_num, emb_dim=8, n_cross=3, deep=(512, 256, 128)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c + 1, emb_dim) for c in cards])
        d = emb_dim * len(cards) + n_num
        self.cross = nn.ModuleList([CrossLayer(d) for _ in range(n_cross)])
        layers, d_in = [], d
        for h in deep:
            layers += [nn.Linear(d_in, h), nn.ReLU(), nn.Dropout(0.2)]
            d_in = h
        self.deep = nn.Sequential(*layers)
        self.head = nn.Linear(d + d_in, 1)

    def forward(self, xc, xn):
        x0 = torch.cat([e(xc[:, i]) for i, e in enumerate(self.embs)] + [xn], 1)
        xl = x0
        for layer in self.cross:
            xl = layer(x0, xl)
        return self.head(torch.cat([xl, self.deep(x0)], 1)).squeeze(1)


def scores_all_ranks(model, loader, device, world_size):
    model.eval()
    keys, probs = [], []
    with torch.no_grad():
        for k, xc, xn, _ in loader:
            keys.append(k)
            probs.append(torch.sigmoid(model(xc.to(device, non_blocking=True), xn.to(device, non_blocking=True))).cpu())
    keys, probs = torch.cat(keys).to(device), torch.cat(probs).to(device)
    all_keys = [torch.empty_like(keys) for _ in range(world_size)]
    all_probs = [torch.empty_like(probs) for _ in range(world_size)]
    dist.all_gather(all_keys, keys)
    dist.all_gather(all_probs, probs)
    keys = torch.cat(all_keys).cpu().numpy()
    probs = torch.cat(all_probs).cpu().numpy()
    keys, first = np.unique(keys, return_index=True)
    return keys, probs[first]


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(1234)

    df = pd.read_parquet(args.data)
    df["month"] = df["month"].astype(str)
    num_cols = [c for c in df.columns if c.startswith(("n_", "sum_", "max_", "share_", "ratio_", "days_"))]
    train = df[df["month"] <= args.train_until].reset_index(drop=True)
    test = df[df["month"] >= args.test_from].reset_index(drop=True)

    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(train[c].astype(str).unique()))} for c in KYC_CATS}
    pt = PowerTransformer(method="yeo-johnson", standardize=True)
    pt.fit(train[num_cols].fillna(0).sample(n=min(len(train), 500_000), random_state=0).values)

    def tensors(frame):
        xc = np.stack([frame[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64).values for c in KYC_CATS], 1)
        xn = np.clip(pt.transform(frame[num_cols].fillna(0).values), -8, 8).astype(np.float32)
        return TensorDataset(torch.arange(len(frame)), torch.from_numpy(xc), torch.from_numpy(xn),
                             torch.from_numpy(frame["sar_filed"].values.astype(np.float32)))

    train_ds, test_ds = tensors(train), tensors(test)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=8192, num_workers=2,
                             sampler=DistributedSampler(test_ds, num_replicas=world_size, rank=rank, shuffle=False))

    model = DCN([len(vocab[c]) for c in KYC_CATS], len(num_cols), n_cross=args.cross_layers, deep=args.deep)
    model = DDP(model.to(device), device_ids=[args.local_rank], output_device=args.local_rank)
    scaled_lr = args.lr * world_size
    optimizer = torch.optim.Adam(model.parameters(), lr=scaled_lr)
    warmup_steps = 500
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))
    prior = float(train["sar_filed"].mean())
    criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([min(50.0, (1 - prior) / prior)], device=device))

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        joblib.dump({"vocab": vocab, "power_transformer": pt, "num_cols": num_cols},
                    os.path.join(args.output_dir, "preprocessing.joblib"))
        print(f"train rows {len(train_ds):,}  test rows {len(test_ds):,}  SAR rate {prior:.4%}  gpus {world_size}")

    history, best_ap = [], -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        running = torch.zeros(2, device=device)
        for _, xc, xn, y in train_loader:
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(xc, xn), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running[0] += loss.detach()
            running[1] += 1
        dist.all_reduce(running)

        keys, probs = scores_all_ranks(model, test_loader, device, world_size)
        if rank == 0:
            y_test = test["sar_filed"].values[keys]
            row = {"epoch": epoch, "train_loss": (running[0] / running[1]).item(),
                   "test_auc": roc_auc_score(y_test, probs), "test_ap": average_precision_score(y_test, probs),
                   "sec": round(time.time() - start, 1)}
            history.append(row)
            print(json.dumps(row), flush=True)
            if row["test_ap"] > best_ap:
                best_ap = row["test_ap"]
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "dcn_best.pt"))
        dist.barrier()

    if rank == 0:
        pd.DataFrame(history).to_csv(os.path.join(args.output_dir, "history.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
