"""Card-transaction fraud model (tabular MLP), plain `srun` launch with requeue on preemption.

    #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
    #SBATCH --signal=USR1@180 --requeue
    srun python 17_fraud_tabular_slurm_requeue.py --parquet $SCRATCH/fraud/transactions.parquet \
        --run-dir $SCRATCH/runs/fraud_mlp
($SCRATCH is the cluster-wide parallel filesystem.)
"""
import argparse
import json
import os
import signal
import subprocess
from contextlib import nullcontext

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STOP_REQUESTED = False


def on_usr1(signum, frame):
    global STOP_REQUESTED
    STOP_REQUESTED = True


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--parquet", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--micro-bs", type=int, default=2048)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--neg-ratio", type=int, default=20, help="negatives kept per positive each epoch")
    p.add_argument("--patience", type=int, default=6)
    return p.parse_args()


def init_from_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = nodes.decode().split()[0]
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    return rank, world, local_rank


def load_features(path):
    df = pd.read_parquet(path)
    df = df.sort_values("event_time")
    df["hour"] = pd.to_datetime(df["event_time"]).dt.hour
    df["log_amount"] = np.log1p(df["amount"].clip(lower=0))
    for col in ["merchant_category", "channel", "country"]:
        df[col] = df[col].astype("category").cat.codes.clip(lower=0)
    num = ["log_amount", "hour", "tx_count_24h", "amount_mean_7d", "distance_home_km", "card_age_days"]
    df[num] = df[num].fillna(0)
    # temporal split: the last 15% of events are the validation period
    cut = int(len(df) * 0.85)
    mu, sd = df[num].iloc[:cut].mean(), df[num].iloc[:cut].std() + 1e-6
    df[num] = (df[num] - mu) / sd
    x_num = torch.tensor(df[num].values, dtype=torch.float32)
    x_cat = torch.tensor(df[["merchant_category", "channel", "country"]].values, dtype=torch.long)
    y = torch.tensor(df["is_fraud"].values, dtype=torch.float32)
    cards = [int(x_cat[:, j].max()) + 1 for j in range(x_cat.shape[1])]
    return TensorDataset(x_num, x_cat, y), cut, cards


class FraudMLP(nn.Module):
    def __init__(self, n_num, cards, emb=16, hidden=512):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(c, emb) for c in cards])
        d = n_num + emb * len(cards)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, 1))

    def forward(self, x_num, x_cat):
        e = [m(x_cat[:, j]) for j, m in enumerate(self.embs)]
        return self.mlp(torch.cat([x_num] + e, dim=1)).squeeze(1)


def epoch_subset(labels, train_end, neg_ratio, epoch):
    """All positives plus a fresh negative sample each epoch; seeded by epoch so every rank picks the same rows."""
    y = labels[:train_end].numpy()
    pos = np.flatnonzero(y == 1)
    neg = np.flatnonzero(y == 0)
    rng = np.random.default_rng(12345 + epoch)
    neg = rng.choice(neg, size=min(len(neg), neg_ratio * len(pos)), replace=False)
    return np.sort(np.concatenate([pos, neg]))


def main():
    a = args_()
    signal.signal(signal.SIGUSR1, on_usr1)
    rank, world, local_rank = init_from_slurm()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    full, cut, cards = load_features(a.parquet)
    val_idx = np.arange(cut, len(full))
    # rank r scores rows r, r+world, ...: no padding, every row counted exactly once
    val_loader = DataLoader(Subset(full, val_idx[rank::world]), batch_size=8192)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(FraudMLP(6, cards)).to(dev)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr * (a.micro_bs * a.accum * world) / 8192)
    scaler = torch.cuda.amp.GradScaler()
    pos_weight = torch.tensor(float(a.neg_ratio) ** 0.5, device=dev)

    os.makedirs(a.run_dir, exist_ok=True)
    ckpt_path = os.path.join(a.run_dir, "state.pt")
    state = {"epoch": 0, "best_ap": 0.0, "bad": 0}
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        state = ck["state"]
        if rank == 0:
            print(f"resuming at epoch {state['epoch']}", flush=True)

    def save(path, extra=None):
        if rank == 0:
            blob = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                    "state": dict(state), "cards": cards, **(extra or {})}
            torch.save(blob, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()

    while state["epoch"] < a.epochs:
        epoch = state["epoch"]
        train_set = Subset(full, epoch_subset(full.tensors[2], cut, a.neg_ratio, epoch))
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=1)
        sampler.set_epoch(epoch)
        loader = DataLoader(train_set, batch_size=a.micro_bs, sampler=sampler, drop_last=True, num_workers=4,
                            pin_memory=True)
        model.train()
        stop = torch.zeros(1, device=dev)
        for i, (xn, xc, y) in enumerate(loader):
            xn, xc, y = xn.to(dev, non_blocking=True), xc.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            last_micro = (i + 1) % a.accum == 0
            with model.no_sync() if not last_micro else nullcontext():
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(xn, xc)
                loss = nn.functional.binary_cross_entropy_with_logits(logits.float(), y, pos_weight=pos_weight)
                scaler.scale(loss / a.accum).backward()
            if last_micro:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            if i % 50 == 0:
                # all ranks agree on whether Slurm asked us to stop
                stop.fill_(1.0 if STOP_REQUESTED else 0.0)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                if stop.item() > 0:
                    break
        if stop.item() > 0:
            save(ckpt_path)  # epoch not advanced: the interrupted epoch is redone after requeue
            if rank == 0:
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
            break

        model.eval()
        scores, labels = [], []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for xn, xc, y in val_loader:
                scores.append(torch.sigmoid(model.module(xn.to(dev), xc.to(dev)).float()).cpu())
                labels.append(y)
        local = (torch.cat(scores).numpy(), torch.cat(labels).numpy())
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        s = np.concatenate([g[0] for g in gathered])
        l = np.concatenate([g[1] for g in gathered])
        ap = float(average_precision_score(l, s))

        state["epoch"] = epoch + 1
        if ap > state["best_ap"]:
            state["best_ap"], state["bad"] = ap, 0
            save(os.path.join(a.run_dir, "best.pt"), {"val_ap": ap})
        else:
            state["bad"] += 1
        save(ckpt_path)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "val_ap": round(ap, 5), "best_ap": round(state["best_ap"], 5)}),
                  flush=True)
        if state["bad"] >= a.patience:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
