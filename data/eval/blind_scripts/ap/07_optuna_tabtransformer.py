"""Optuna search for the cross-sell TabTransformer, every trial trained with DDP.

Rank 0 owns the study (ask/tell); the sampled hyper-parameters are broadcast so all
ranks train the same trial together. Launch:

    torchrun --standalone --nproc_per_node=4 07_optuna_tabtransformer.py --n-trials 40
"""
import argparse
import os

import joblib
import numpy as np
import optuna
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from optuna.trial import TrialState
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT = ["gender", "region_code", "vehicle_age", "vehicle_damage", "policy_channel", "previously_insured", "age_band"]
NUM = ["age", "annual_premium", "vintage"]
TARGET = "response"


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", default="data/cross_sell/train.csv")
    p.add_argument("--n-trials", type=int, default=40)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--out", default="runs/optuna_tabtf")
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


class TabTransformer(nn.Module):
    def __init__(self, cards, n_num, dim, depth, heads, attn_dropout, mlp_mult):
        super().__init__()
        self.register_buffer("offsets", torch.tensor([0] + list(np.cumsum(cards)[:-1]), dtype=torch.long))
        self.embed = nn.Embedding(int(sum(cards)), dim)
        enc = nn.TransformerEncoderLayer(dim, heads, dim * 4, attn_dropout, batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(enc, depth)
        self.num_ln = nn.LayerNorm(n_num)
        d_in = dim * len(cards) + n_num
        self.mlp = nn.Sequential(nn.Linear(d_in, d_in * mlp_mult), nn.ReLU(),
                                 nn.Linear(d_in * mlp_mult, d_in * mlp_mult // 2), nn.ReLU(),
                                 nn.Linear(d_in * mlp_mult // 2, 1))

    def forward(self, x_cat, x_num):
        ctx = self.transformer(self.embed(x_cat + self.offsets))
        return self.mlp(torch.cat([ctx.flatten(1), self.num_ln(x_num)], 1)).squeeze(-1)


def load_data(path, seed):
    df = pd.read_csv(path)
    df["age_band"] = pd.cut(df["age"], [0, 25, 35, 45, 55, 65, 120], labels=False).astype(str)
    cards = []
    for c in CAT:
        codes, uniques = pd.factorize(df[c].astype(str), sort=True)
        df[c] = codes
        cards.append(len(uniques))
    for c in NUM:
        df[c] = (np.log1p(df[c]) - np.log1p(df[c]).mean()) / np.log1p(df[c]).std()
    # fixed-seed permutation: identical on every rank
    perm = np.random.RandomState(seed).permutation(len(df))
    n_val = int(0.2 * len(df))
    va, tr = df.iloc[perm[:n_val]], df.iloc[perm[n_val:]]

    def ds(frame):
        return TensorDataset(torch.arange(len(frame)), torch.tensor(frame[CAT].values, dtype=torch.long),
                             torch.tensor(frame[NUM].values, dtype=torch.float32),
                             torch.tensor(frame[TARGET].values, dtype=torch.float32))
    return ds(tr), ds(va), cards


def run_trial(params, data, args, device, local_rank, world_size, trial=None):
    train_ds, valid_ds, cards = data
    torch.manual_seed(args.seed)
    model = TabTransformer(cards, len(NUM), params["dim"], params["depth"], params["heads"],
                           params["dropout"], params["mlp_mult"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], weight_decay=params["wd"])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=params["batch_size"] // world_size, sampler=sampler,
                        num_workers=4, pin_memory=True)
    vloader = DataLoader(valid_ds, batch_size=8192, sampler=DistributedSampler(valid_ds, shuffle=False))
    pos_w = torch.tensor(params["pos_weight"], device=device)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for _, xc, xn, y in loader:
            xc, xn, y = xc.to(device), xn.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(xc, xn)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        local = []
        with torch.no_grad():
            for idx, xc, xn, y in vloader:
                p = torch.sigmoid(model(xc.to(device), xn.to(device)).float())
                local.append((idx.numpy(), p.cpu().numpy(), y.numpy()))
        every = [None] * world_size
        dist.all_gather_object(every, local)
        idx = np.concatenate([a for part in every for a, _, _ in part])
        prob = np.concatenate([b for part in every for _, b, _ in part])
        lab = np.concatenate([c for part in every for _, _, c in part])
        _, keep = np.unique(idx, return_index=True)
        auc = roc_auc_score(lab[keep], prob[keep])
        best = max(best, auc)

        prune = torch.zeros(1, device=device)
        if trial is not None:
            trial.report(auc, epoch)
            if trial.should_prune():
                prune += 1
        dist.broadcast(prune, src=0)
        if prune.item():
            raise optuna.TrialPruned()
    return best


def suggest(trial):
    return {
        "dim": trial.suggest_categorical("dim", [16, 32, 64]),
        "depth": trial.suggest_int("depth", 2, 6),
        "heads": trial.suggest_categorical("heads", [2, 4, 8]),
        "dropout": trial.suggest_float("dropout", 0.0, 0.3),
        "mlp_mult": trial.suggest_int("mlp_mult", 1, 4),
        "lr": trial.suggest_float("lr", 1e-4, 3e-3, log=True),
        "wd": trial.suggest_float("wd", 1e-6, 1e-3, log=True),
        "batch_size": trial.suggest_categorical("batch_size", [1024, 2048, 4096]),
        "pos_weight": trial.suggest_float("pos_weight", 1.0, 8.0),
    }


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    data = load_data(args.train, args.seed)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        study = optuna.create_study(direction="maximize", study_name="tabtf_cross_sell",
                                    sampler=optuna.samplers.TPESampler(seed=args.seed),
                                    pruner=optuna.pruners.MedianPruner(n_warmup_steps=2))
        for _ in range(args.n_trials):
            trial = study.ask()
            params = suggest(trial)
            dist.broadcast_object_list([params], src=0)
            try:
                value = run_trial(params, data, args, device, local_rank, world_size, trial)
            except optuna.TrialPruned:
                study.tell(trial, state=TrialState.PRUNED)
                continue
            study.tell(trial, value)
            print(f"trial {trial.number}: auc {value:.5f} | best {study.best_value:.5f} {study.best_params}", flush=True)
        dist.broadcast_object_list([None], src=0)
        study.trials_dataframe().to_csv(os.path.join(args.out, "trials.csv"), index=False)
        joblib.dump(study, os.path.join(args.out, "study.pkl"))
    else:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                break
            try:
                run_trial(msg[0], data, args, device, local_rank, world_size)
            except optuna.TrialPruned:
                pass

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
