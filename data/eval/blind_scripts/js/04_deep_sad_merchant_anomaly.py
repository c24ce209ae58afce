"""Deep SAD anomaly scoring for merchant-side transactions.

Mostly-unlabelled data plus a small set of confirmed fraud chargebacks.
Hypersphere center is estimated from an initial forward pass over the training data
(all ranks contribute), then the encoder is trained to pull normal traffic towards
the center and push the labelled anomalies away.

Launch:
    torchrun --standalone --nproc_per_node=4 04_deep_sad_merchant_anomaly.py --config configs/deepsad.yaml
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = {
    "train_path": "/data/merchant_txn/train.parquet",
    "val_path": "/data/merchant_txn/val.parquet",
    "out_dir": "outputs/deepsad",
    "rep_dim": 32,
    "hidden": [256, 128],
    "eta": 1.0,
    "lr": 5e-4,
    "weight_decay": 1e-6,
    "epochs": 30,
    "batch_size": 1024,
    "num_workers": 4,
    "seed": 7,
}
CAT_COLS = ["mcc", "entry_mode", "country", "currency"]


class TxnEncoder(nn.Module):
    # no bias terms anywhere: a bias lets the network map everything onto the center
    def __init__(self, n_num, cat_sizes, hidden, rep_dim):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(n, min(16, (n + 1) // 2)) for n in cat_sizes])
        d = n_num + sum(e.embedding_dim for e in self.embs)
        layers = []
        for h in hidden:
            layers += [nn.Linear(d, h, bias=False), nn.LeakyReLU(0.1)]
            d = h
        layers.append(nn.Linear(d, rep_dim, bias=False))
        self.net = nn.Sequential(*layers)
        self.register_buffer("center", torch.zeros(rep_dim))

    def forward(self, x_num, x_cat):
        e = [emb(x_cat[:, i]) for i, emb in enumerate(self.embs)]
        return self.net(torch.cat([x_num] + e, dim=1))

    def anomaly_score(self, x_num, x_cat):
        z = self.forward(x_num, x_cat)
        return ((z - self.center) ** 2).sum(dim=1)


def load_split(path, cat_maps=None, stats=None):
    df = pd.read_parquet(path)
    num_cols = [c for c in df.columns if c.startswith("f_")]
    x_num = df[num_cols].astype("float32").fillna(0.0).values
    if stats is None:
        stats = (x_num.mean(0), x_num.std(0) + 1e-6)
    x_num = (x_num - stats[0]) / stats[1]
    if cat_maps is None:
        cat_maps = {c: {v: i + 1 for i, v in enumerate(sorted(df[c].astype(str).unique()))} for c in CAT_COLS}
    x_cat = np.stack([df[c].astype(str).map(cat_maps[c]).fillna(0).astype("int64").values for c in CAT_COLS], 1)
    # semi_label: +1 labelled normal, -1 confirmed fraud, 0 unlabelled
    semi = df["semi_label"].values.astype("int64") if "semi_label" in df else np.zeros(len(df), dtype="int64")
    y = df["is_fraud"].values.astype("int64")
    ds = TensorDataset(torch.from_numpy(x_num), torch.from_numpy(x_cat), torch.from_numpy(semi), torch.from_numpy(y))
    return ds, cat_maps, stats, len(num_cols)


@torch.no_grad()
def init_center(model, loader, device, eps=0.1):
    model.eval()
    s = torch.zeros(model.center.numel(), device=device, dtype=torch.float64)
    n = torch.zeros(1, device=device, dtype=torch.float64)
    for x_num, x_cat, _, _ in loader:
        z = model(x_num.to(device), x_cat.to(device))
        s += z.double().sum(0)
        n += z.size(0)
    dist.all_reduce(s)
    dist.all_reduce(n)
    c = (s / n).float()
    # keep coordinates away from zero so trivial solutions are not reachable
    c[(c.abs() < eps) & (c < 0)] = -eps
    c[(c.abs() < eps) & (c >= 0)] = eps
    model.center.copy_(c)


@torch.no_grad()
def validate(model, ds, device, rank, world, batch_size):
    model.eval()
    idx = list(range(rank, len(ds), world))
    loader = DataLoader(torch.utils.data.Subset(ds, idx), batch_size=batch_size * 4, shuffle=False)
    scores, labels = [], []
    for x_num, x_cat, _, y in loader:
        scores.append(model.anomaly_score(x_num.to(device), x_cat.to(device)).cpu())
        labels.append(y)
    local = torch.stack([torch.cat(scores), torch.cat(labels).float()], 1).numpy()
    parts = [None] * world
    dist.all_gather_object(parts, local)
    arr = np.concatenate(parts)
    return average_precision_score(arr[:, 1], arr[:, 0]), roc_auc_score(arr[:, 1], arr[:, 0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    cli = parser.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])

    train_ds, cat_maps, stats, n_num = load_split(cfg["train_path"])
    val_ds, _, _, _ = load_split(cfg["val_path"], cat_maps, stats)
    cat_sizes = [len(cat_maps[c]) + 1 for c in CAT_COLS]

    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)

    encoder = TxnEncoder(n_num, cat_sizes, cfg["hidden"], cfg["rep_dim"]).to(device)
    init_center(encoder, train_loader, device)
    model = DDP(encoder, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(cfg["epochs"] * 0.7)], gamma=0.1)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"train={len(train_ds)} val={len(val_ds)} world={world} center_norm={encoder.center.norm():.3f}")

    eta, best_ap = cfg["eta"], -1.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x_num, x_cat, semi, _ in train_loader:
            x_num, x_cat, semi = x_num.to(device), x_cat.to(device), semi.to(device)
            z = model(x_num, x_cat)
            dist2 = ((z - encoder.center) ** 2).sum(1)
            per_sample = torch.where(semi == 0, dist2, eta * (dist2 + 1e-6) ** semi.float())
            loss = per_sample.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum[0] += loss.detach() * z.size(0)
            loss_sum[1] += z.size(0)
        sched.step()
        dist.all_reduce(loss_sum)

        ap, auc = validate(model, val_ds, device, rank, world, cfg["batch_size"])
        if rank == 0:
            print(f"[{epoch:03d}] loss={loss_sum[0] / loss_sum[1]:.5f} val_ap={ap:.4f} val_auc={auc:.4f} "
                  f"lr={sched.get_last_lr()[0]:.2e} {time.time() - t0:.1f}s", flush=True)
            if ap > best_ap:
                best_ap = ap
                torch.save({"model": encoder.state_dict(), "cat_maps": cat_maps, "stats": stats, "cfg": cfg},
                           os.path.join(cfg["out_dir"], "deepsad_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
