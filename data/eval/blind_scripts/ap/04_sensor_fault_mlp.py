"""Fault-type classification for the compressor line from aggregated sensor windows.

Input: one row per (machine, 10 min window) with rolling statistics per sensor and a
fault_type label (0 = normal, 1..K-1 fault classes). Residual MLP, macro-F1 on the last
two weeks. Run with:

    torchrun --nproc_per_node=4 04_sensor_fault_mlp.py --features data/compressor_windows.parquet
"""
import argparse
import logging
import os
import pickle

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import confusion_matrix
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--features", default="data/compressor_windows.parquet")
    ap.add_argument("--holdout-days", type=int, default=14)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=256, help="per GPU")
    ap.add_argument("--base-lr", type=float, default=1e-3, help="lr for a global batch of 256")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--ckpt-dir", default="checkpoints/compressor_mlp")
    return ap.parse_args()


class ResBlock(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Dropout(dropout), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.net(x)


class FaultMLP(nn.Module):
    def __init__(self, n_in, n_classes, n_machines, hidden, blocks, dropout):
        super().__init__()
        self.machine_emb = nn.Embedding(n_machines, 16)
        self.inp = nn.Linear(n_in + 16, hidden)
        self.blocks = nn.Sequential(*[ResBlock(hidden, dropout) for _ in range(blocks)])
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, n_classes))

    def forward(self, x, machine):
        h = self.inp(torch.cat([x, self.machine_emb(machine)], dim=1))
        return self.out(self.blocks(h))


def macro_f1_from_cm(cm):
    tp = np.diag(cm).astype(float)
    fp = cm.sum(0) - tp
    fn = cm.sum(1) - tp
    f1 = 2 * tp / np.maximum(2 * tp + fp + fn, 1)
    return f1.mean(), f1


def evaluate(model, ds, n_classes, device, rank, world_size):
    # plain strided shard, no padding, so every window is counted exactly once
    shard = Subset(ds, list(range(rank, len(ds), world_size)))
    loader = DataLoader(shard, batch_size=4096, num_workers=2)
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for x, m, y in loader:
            logits = model.module(x.to(device), m.to(device))
            preds.append(logits.argmax(1).cpu().numpy())
            labels.append(y.numpy())
    cm = confusion_matrix(np.concatenate(labels), np.concatenate(preds), labels=list(range(n_classes)))
    cm = torch.from_numpy(cm)
    dist.all_reduce(cm, op=dist.ReduceOp.SUM)
    return cm.numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")

    df = pd.read_parquet(args.features).sort_values("window_start")
    cutoff = df["window_start"].max() - pd.Timedelta(days=args.holdout_days)
    feat_cols = [c for c in df.columns if c.startswith(("mean_", "std_", "min_", "max_", "slope_"))]
    machines = {m: i for i, m in enumerate(sorted(df["machine_id"].unique()))}
    n_classes = int(df["fault_type"].max()) + 1

    train_df, test_df = df[df["window_start"] <= cutoff], df[df["window_start"] > cutoff]
    qt = QuantileTransformer(n_quantiles=1000, output_distribution="normal", subsample=200_000, random_state=0)
    qt.fit(train_df[feat_cols].fillna(0).values)

    def make_ds(frame):
        x = torch.tensor(qt.transform(frame[feat_cols].fillna(0).values), dtype=torch.float32)
        m = torch.tensor(frame["machine_id"].map(machines).values, dtype=torch.long)
        y = torch.tensor(frame["fault_type"].values, dtype=torch.long)
        return TensorDataset(x, m, y)

    train_ds, test_ds = make_ds(train_df), make_ds(test_df)
    counts = np.bincount(train_df["fault_type"].values, minlength=n_classes)
    class_w = torch.tensor((counts.sum() / np.maximum(counts, 1)) ** 0.5, dtype=torch.float32, device=device)
    class_w = class_w / class_w.mean()
    log.info("train %d windows, test %d windows, class counts %s", len(train_ds), len(test_ds), counts.tolist())

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, persistent_workers=True)

    model = FaultMLP(len(feat_cols), n_classes, len(machines), args.hidden, args.blocks, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world_size / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_loader))
    loss_fn = nn.CrossEntropyLoss(weight=class_w, label_smoothing=0.05)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_f1 = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, m, y in train_loader:
            x, m, y = x.to(device, non_blocking=True), m.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x, m), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot[0] += loss.detach() * len(y)
            tot[1] += len(y)
        dist.all_reduce(tot)

        cm = evaluate(model, test_ds, n_classes, device, rank, world_size)
        macro, per_class = macro_f1_from_cm(cm)
        log.info("epoch %d | loss %.4f | macro-F1 %.4f | per class %s", epoch, (tot[0] / tot[1]).item(),
                 macro, np.round(per_class, 3).tolist())
        if rank == 0 and macro > best_f1:
            best_f1 = macro
            torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pt"))
            with open(os.path.join(args.ckpt_dir, "preprocess.pkl"), "wb") as f:
                pickle.dump({"qt": qt, "machines": machines, "feat_cols": feat_cols}, f)
            np.save(os.path.join(args.ckpt_dir, "confusion_best.npy"), cm)
        dist.barrier()

    log.info("best macro-F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
