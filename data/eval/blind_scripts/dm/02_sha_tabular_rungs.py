"""Successive halving over MLP configurations for tabular classification,
followed by a data-parallel retrain of the winner.

Phase 1: every rank trains one sampled configuration on its own GPU.  At each
rung (epochs r0, r0*eta, r0*eta^2, ...) the scores are shared, and only the
top 1/eta of the surviving trials keep training.  Stopped trials stay in the
rung loop (they just skip training) so every rank joins every exchange.

Phase 2: all ranks retrain the best configuration on train+val with DDP.

    torchrun --standalone --nproc_per_node=8 sha_tabular.py --data covtype.npz
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/covtype.npz")
    ap.add_argument("--out", default="runs/sha_covtype")
    ap.add_argument("--min-epochs", type=int, default=2)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--max-epochs", type=int, default=32)
    ap.add_argument("--retrain-epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


class MLP(nn.Module):
    def __init__(self, d_in, n_classes, width, depth, dropout):
        super().__init__()
        layers, d = [], d_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.LayerNorm(width), nn.SiLU(), nn.Dropout(dropout)]
            d = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


def load_data(path):
    z = np.load(path)
    x_tr, y_tr = z["x_train"].astype(np.float32), z["y_train"].astype(np.int64)
    x_va, y_va = z["x_val"].astype(np.float32), z["y_val"].astype(np.int64)
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_va = (x_tr - mu) / sd, (x_va - mu) / sd
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr),
            torch.from_numpy(x_va), torch.from_numpy(y_va))


def sample_configs(n, seed):
    # same stream on every rank -> rank r takes configs[r]
    rng = np.random.default_rng(seed)
    configs = []
    for _ in range(n):
        configs.append({
            "lr": float(10 ** rng.uniform(-4, -2)),
            "weight_decay": float(10 ** rng.uniform(-6, -3)),
            "width": int(rng.choice([128, 256, 512, 1024])),
            "depth": int(rng.integers(2, 6)),
            "dropout": float(rng.uniform(0.0, 0.3)),
            "batch_size": int(rng.choice([256, 512, 1024])),
        })
    return configs


def run_epoch(model, loader, optimizer, device):
    model.train()
    for xb, yb in loader:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def accuracy(model, x, y, device, bs=8192):
    model.eval()
    correct = 0
    for i in range(0, len(x), bs):
        logits = model(x[i:i + bs].to(device))
        correct += (logits.argmax(1).cpu() == y[i:i + bs]).sum().item()
    return correct / len(x)


def successive_halving(args, rank, world, device, data):
    x_tr, y_tr, x_va, y_va = data
    cfg = sample_configs(world, args.seed)[rank]
    torch.manual_seed(args.seed + rank)
    model = MLP(x_tr.shape[1], int(y_tr.max()) + 1, cfg["width"], cfg["depth"],
                cfg["dropout"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=cfg["batch_size"],
                        shuffle=True, drop_last=True, pin_memory=True)

    rungs, r = [], args.min_epochs
    while r <= args.max_epochs:
        rungs.append(r)
        r *= args.eta

    alive, epochs_done, score = True, 0, float("nan")
    board = []
    for rung in rungs:
        if alive:
            while epochs_done < rung:
                run_epoch(model, loader, opt, device)
                epochs_done += 1
            score = accuracy(model, x_va, y_va, device)

        board = [None] * world
        dist.all_gather_object(board, {"rank": rank, "alive": alive, "score": score,
                                       "epochs": epochs_done, "config": cfg})
        survivors = sorted((b for b in board if b["alive"]),
                           key=lambda b: (-b["score"], b["rank"]))
        keep = max(1, len(survivors) // args.eta)
        keep_ranks = {b["rank"] for b in survivors[:keep]}
        alive = alive and rank in keep_ranks
        if rank == 0:
            print(f"[rung {rung:3d}] survivors={len(survivors)} keep={keep} "
                  f"best={survivors[0]['score']:.4f} (rank {survivors[0]['rank']})", flush=True)
    return board


def retrain(args, rank, world, device, data, cfg):
    x_tr, y_tr, x_va, y_va = data
    x_all, y_all = torch.cat([x_tr, x_va]), torch.cat([y_tr, y_va])
    ds = TensorDataset(x_all, y_all)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, drop_last=True,
                        pin_memory=True)

    torch.manual_seed(args.seed)
    model = MLP(x_all.shape[1], int(y_all.max()) + 1, cfg["width"], cfg["depth"],
                cfg["dropout"]).to(device)
    model = DDP(model, device_ids=[device.index])
    # the search used one GPU per trial; the global batch is now world x larger,
    # so scale the learning rate linearly and warm up for the first epochs
    base_lr = cfg["lr"] * world
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=cfg["weight_decay"])
    steps_per_epoch = len(loader)
    total = args.retrain_epochs * steps_per_epoch
    warmup = 3 * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    for epoch in range(args.retrain_epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach() * xb.size(0),
                                     torch.tensor(float(xb.size(0)), device=device)])
        dist.all_reduce(loss_sum)
        if rank == 0 and (epoch % 5 == 0 or epoch == args.retrain_epochs - 1):
            print(f"[retrain] epoch {epoch} loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
    return model


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = load_data(args.data)
    t0 = time.time()
    board = successive_halving(args, rank, world, device, data)
    winner = max((b for b in board if b["alive"]), key=lambda b: (b["score"], -b["rank"]))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "leaderboard.json"), "w") as f:
            json.dump(sorted(board, key=lambda b: (not b["alive"], -b["epochs"], -b["score"])),
                      f, indent=2)
        print(f"search done in {time.time() - t0:.0f}s, winner rank {winner['rank']} "
              f"acc {winner['score']:.4f}: {winner['config']}", flush=True)

    model = retrain(args, rank, world, device, data, winner["config"])
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "config": winner["config"]},
                   os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
