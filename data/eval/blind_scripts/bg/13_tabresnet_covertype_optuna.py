"""Hyper-parameter search for a tabular ResNet (Gorishniy et al. 2021) on Forest Covertype.

Every trial is trained data-parallel on all GPUs of the node.

    torchrun --nproc_per_node=4 13_tabresnet_covertype_optuna.py --trials 50 --epochs 30
"""
import argparse
import json
import os

import numpy as np
import optuna
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import fetch_covtype
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import QuantileTransformer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class ResBlock(nn.Module):
    def __init__(self, d, d_hidden, drop_hidden, drop_res):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d)
        self.drop_hidden = nn.Dropout(drop_hidden)
        self.drop_res = nn.Dropout(drop_res)

    def forward(self, x):
        h = self.drop_hidden(F.relu(self.fc1(self.norm(x))))
        return x + self.drop_res(self.fc2(h))


class TabResNet(nn.Module):
    def __init__(self, d_in, n_classes, d, n_blocks, hidden_factor, drop_hidden, drop_res):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(*[ResBlock(d, int(d * hidden_factor), drop_hidden, drop_res)
                                      for _ in range(n_blocks)])
        self.head = nn.Sequential(nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, n_classes))

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def load_covtype(seed, cache_dir):
    X, y = fetch_covtype(data_home=cache_dir, return_X_y=True)
    y = y - 1
    X_tr, X_tmp, y_tr, y_tmp = train_test_split(X, y, test_size=0.36, random_state=seed, stratify=y)
    X_va, X_te, y_va, y_te = train_test_split(X_tmp, y_tmp, test_size=0.5, random_state=seed, stratify=y_tmp)
    # the 10 continuous columns get a quantile transform, the one-hot ones are left alone
    qt = QuantileTransformer(output_distribution="normal", n_quantiles=1000, subsample=10**9, random_state=seed)
    X_tr[:, :10] = qt.fit_transform(X_tr[:, :10])
    X_va[:, :10] = qt.transform(X_va[:, :10])
    X_te[:, :10] = qt.transform(X_te[:, :10])
    to_ds = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.long))
    return to_ds(X_tr, y_tr), to_ds(X_va, y_va), to_ds(X_te, y_te)


def accuracy(net, ds, device, rank, world):
    net.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=8192)
    c = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            c[0] += (net(x).argmax(1) == y).sum()
            c[1] += len(y)
    dist.all_reduce(c)
    net.train()
    return (c[0] / c[1]).item()


def train_one(cfg, data, args, device, rank, world, trial=None):
    train_ds, val_ds, _ = data
    net = TabResNet(train_ds.tensors[0].shape[1], 7, cfg["d"], cfg["n_blocks"], cfg["hidden_factor"],
                    cfg["drop_hidden"], cfg["drop_res"]).to(device)
    model = DDP(net, device_ids=[device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["wd"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        drop_last=True, num_workers=2, pin_memory=True)
    best_acc, best_state, stale = 0.0, None, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        acc = accuracy(net, val_ds, device, rank, world)
        if acc > best_acc:
            best_acc, stale = acc, 0
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        else:
            stale += 1
            if stale >= args.patience:
                break
    return best_acc, best_state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-cache", default="data/sklearn")
    ap.add_argument("--out", default="sweeps/tabresnet_covtype")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        fetch_covtype(data_home=args.data_cache)  # download once before the others read it
    dist.barrier()
    data = load_covtype(args.seed, args.data_cache)
    best_overall = {"acc": 0.0}

    def objective(trial):
        cfg = {
            "d": trial.suggest_int("d", 64, 512, log=True),
            "n_blocks": trial.suggest_int("n_blocks", 1, 8),
            "hidden_factor": trial.suggest_float("hidden_factor", 1.0, 4.0),
            "drop_hidden": trial.suggest_float("drop_hidden", 0.0, 0.5),
            "drop_res": trial.suggest_float("drop_res", 0.0, 0.5),
            "lr": trial.suggest_float("lr", 1e-5, 1e-2, log=True),
            "wd": trial.suggest_float("wd", 1e-6, 1e-3, log=True),
        }
        torch.manual_seed(args.seed + trial.number)
        acc, state = train_one(cfg, data, args, device, rank, world, trial)
        if rank == 0 and acc > best_overall["acc"]:
            best_overall.update(acc=acc, cfg=cfg)
            torch.save({"cfg": cfg, "state_dict": state}, os.path.join(args.out, "best_model.pt"))
        return acc

    study = optuna.create_study(direction="maximize", study_name="tabresnet_covtype")
    study.optimize(objective, n_trials=args.trials)

    if rank == 0:
        study.trials_dataframe().to_csv(os.path.join(args.out, "trials.csv"), index=False)
        with open(os.path.join(args.out, "best.json"), "w") as f:
            json.dump({"val_acc": study.best_value, "params": study.best_params}, f, indent=2)
        print(f"best val acc {study.best_value:.4f}: {study.best_params}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
