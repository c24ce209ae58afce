"""MMoE ranking model trained on three behaviour logs at once.

click (binary), purchase (binary) and dwell time (regression) come from separate
logs with their own sizes; each log has its own loader. Shared sparse embeddings
and experts, one gate + tower per task. Losses are combined with Dynamic Weight
Average over the epoch-level loss curves.

    torchrun --nproc_per_node=8 mmoe_train.py --data /data/rec_logs --epochs 8
"""
import argparse
import glob
import math
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

SPARSE = ["user_id", "item_id", "cate_id", "brand_id", "city", "device", "hour"]
HASH_SIZE = {"user_id": 2_000_000, "item_id": 1_000_000, "cate_id": 10_000, "brand_id": 200_000,
             "city": 4_000, "device": 64, "hour": 24}
DENSE = ["price", "item_ctr_7d", "user_act_30d", "item_age_days"]
TASKS = [("click", "bce"), ("purchase", "bce"), ("dwell", "mse")]


class LogDataset(Dataset):
    def __init__(self, files, target):
        df = pd.concat([pd.read_parquet(f, columns=SPARSE + DENSE + [target]) for f in sorted(files)])
        self.sparse = np.stack([df[c].values % HASH_SIZE[c] for c in SPARSE], 1).astype(np.int64)
        dense = df[DENSE].values.astype(np.float32)
        self.dense = np.log1p(np.clip(dense, 0, None))
        y = df[target].values.astype(np.float32)
        self.y = np.log1p(y) if target == "dwell" else y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.sparse[i]), torch.from_numpy(self.dense[i]), torch.tensor(self.y[i])


class MMoE(nn.Module):
    def __init__(self, emb_dim=16, n_experts=8, expert_dim=256, tower_dim=128):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(HASH_SIZE[c], emb_dim) for c in SPARSE])
        d_in = emb_dim * len(SPARSE) + len(DENSE)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(d_in, 512), nn.ReLU(), nn.Linear(512, expert_dim), nn.ReLU())
                                      for _ in range(n_experts)])
        self.gates = nn.ModuleList([nn.Linear(d_in, n_experts) for _ in TASKS])
        self.towers = nn.ModuleList([nn.Sequential(nn.Linear(expert_dim, tower_dim), nn.ReLU(), nn.Linear(tower_dim, 1))
                                     for _ in TASKS])

    def task_output(self, t, sparse, dense):
        x = torch.cat([e(sparse[:, i]) for i, e in enumerate(self.embs)] + [dense], 1)
        ex = torch.stack([e(x) for e in self.experts], 1)  # B x E x D
        g = F.softmax(self.gates[t](x), -1).unsqueeze(-1)
        return self.towers[t]((g * ex).sum(1)).squeeze(-1)

    def forward(self, batches):
        return [self.task_output(t, s, d) for t, (s, d) in enumerate(batches)]


class DynamicWeightAverage:
    def __init__(self, n_tasks, temperature=2.0):
        self.n = n_tasks
        self.T = temperature
        self.weights = torch.ones(n_tasks, device=DEVICE)
        self.history = []

    def end_epoch(self, epoch_losses):
        self.history.append(epoch_losses)
        if len(self.history) >= 2:
            r = torch.tensor([a / max(b, 1e-8) for a, b in zip(self.history[-1], self.history[-2])])
            w = torch.softmax(r / self.T, 0) * self.n
            self.weights = w.to(DEVICE)

    def __call__(self, losses):
        return (self.weights * losses).sum()


def task_loss(kind, pred, y):
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(pred, y)
    return F.mse_loss(pred, y)


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    out = {}
    for t, (name, kind) in enumerate(TASKS):
        ds = val_sets[name]
        sub = torch.utils.data.Subset(ds, range(rank, len(ds), world))
        preds, ys = [], []
        for s, d, y in DataLoader(sub, batch_size=8192, num_workers=4):
            preds.append(net.task_output(t, s.to(device), d.to(device)).float().cpu())
            ys.append(y)
        local = (torch.cat(preds).numpy(), torch.cat(ys).numpy())
        parts = [None] * world
        dist.all_gather_object(parts, local)
        p = np.concatenate([x[0] for x in parts])
        y = np.concatenate([x[1] for x in parts])
        out[name] = roc_auc_score(y, p) if kind == "bce" else float(np.sqrt(np.mean((p - y) ** 2)))
    net.train()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch_size", type=int, default=4096, help="per task per GPU")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--dwa_T", type=float, default=2.0)
    ap.add_argument("--out", default="models/mmoe")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_sets = {n: LogDataset(glob.glob(os.path.join(args.data, n, "train", "*.parquet")), n) for n, _ in TASKS}
    val_sets = {n: LogDataset(glob.glob(os.path.join(args.data, n, "val", "*.parquet")), n) for n, _ in TASKS}
    samplers = {n: DistributedSampler(ds, shuffle=True, drop_last=True) for n, ds in train_sets.items()}
    loaders = {n: DataLoader(ds, batch_size=args.batch_size, sampler=samplers[n], num_workers=6,
                             pin_memory=True, drop_last=True) for n, ds in train_sets.items()}
    # the largest log defines the epoch, smaller ones wrap around
    steps = max(len(l) for l in loaders.values())

    net = MMoE().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * args.epochs, eta_min=args.lr * 0.05)
    dwa = DynamicWeightAverage(len(TASKS), args.dwa_T)

    for epoch in range(args.epochs):
        for n in samplers:
            samplers[n].set_epoch(epoch)
        its = {n: iter(l) for n, l in loaders.items()}
        wraps = {n: 0 for n in loaders}
        epoch_sum = torch.zeros(len(TASKS), device=device)
        t0 = time.time()
        for step in range(steps):
            batches, ys = [], []
            for n, _ in TASKS:
                try:
                    s, d, y = next(its[n])
                except StopIteration:
                    wraps[n] += 1
                    samplers[n].set_epoch(epoch * 100 + wraps[n])
                    its[n] = iter(loaders[n])
                    s, d, y = next(its[n])
                batches.append((s.to(device, non_blocking=True), d.to(device, non_blocking=True)))
                ys.append(y.to(device, non_blocking=True))
            preds = model(batches)
            losses = torch.stack([task_loss(k, p, y) for (_, k), p, y in zip(TASKS, preds, ys)])
            loss = dwa(losses)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            epoch_sum += losses.detach()

        dist.all_reduce(epoch_sum, op=dist.ReduceOp.AVG)
        dwa.end_epoch((epoch_sum / steps).tolist())
        metrics = evaluate(net, val_sets, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s loss {(epoch_sum / steps).tolist()} "
                  f"weights {dwa.weights.tolist()} val {metrics}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "dwa_history": dwa.history,
                        "epoch": epoch}, os.path.join(args.out, f"mmoe_ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
