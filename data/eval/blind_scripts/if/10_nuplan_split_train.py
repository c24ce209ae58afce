"""Vectorized ego planner (UrbanDriver-like) trained on nuPlan mini/trainval exported scenarios.

Train / val are split by log so that no driving log appears in both.

    torchrun --nproc_per_node=8 10_nuplan_split_train.py --root /data/nuplan/exported \
        --val-fraction 0.1 --save /data/exp/urbandriver_v4
"""
import argparse
import json
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST, FUT = 11, 16  # 2 Hz: 5 s history, 8 s plan


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_manifest(root):
    with open(os.path.join(root, "manifest.json")) as f:
        rows = json.load(f)  # [{"token": ..., "log_name": ..., "scenario_type": ...}, ...]
    by_log = defaultdict(list)
    for r in rows:
        by_log[r["log_name"]].append(r["token"])
    return by_log


class ExportedScenarios(Dataset):
    def __init__(self, root, tokens, perturb_prob=0.0):
        self.root = root
        self.tokens = tokens
        self.perturb_prob = perturb_prob

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, "scenes", self.tokens[i] + ".npz"))
        ego_hist = d["ego_hist"].astype(np.float32)  # [HIST, 4] x, y, yaw, speed (ego frame)
        ego_fut = d["ego_fut"].astype(np.float32)  # [FUT, 3]
        if random.random() < self.perturb_prob:
            # lateral / heading perturbation of the history, future re-anchored smoothly
            dy = random.uniform(-1.0, 1.0)
            dyaw = random.uniform(-0.25, 0.25)
            w = np.linspace(1.0, 0.0, HIST, dtype=np.float32)[::-1]
            ego_hist[:, 1] += dy * w
            ego_hist[:, 2] += dyaw * w
            blend = np.linspace(1.0, 0.0, FUT, dtype=np.float32)
            ego_fut[:, 1] += dy * blend
        return {
            "ego_hist": torch.from_numpy(ego_hist),
            "agents": torch.from_numpy(d["agents"].astype(np.float32)),  # [32, HIST, 5]
            "agents_mask": torch.from_numpy(d["agents_mask"].astype(np.bool_)),
            "lanes": torch.from_numpy(d["lanes"].astype(np.float32)),  # [128, 10, 5]
            "lanes_mask": torch.from_numpy(d["lanes_mask"].astype(np.bool_)),
            "ego_fut": torch.from_numpy(ego_fut),
        }


class LocalSubgraph(nn.Module):
    def __init__(self, in_dim, d, layers=3):
        super().__init__()
        self.inp = nn.Linear(in_dim, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(2 * d, d), nn.LayerNorm(d), nn.ReLU())
                                    for _ in range(layers))

    def forward(self, x):  # [B, E, P, C]
        h = F.relu(self.inp(x))
        for layer in self.layers:
            g = h.max(2, keepdim=True).values.expand_as(h)
            h = layer(torch.cat([h, g], -1))
        return h.max(2).values


class VectorPlanner(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.ego = LocalSubgraph(4, d)
        self.agents = LocalSubgraph(5, d)
        self.lanes = LocalSubgraph(5, d)
        self.type_emb = nn.Embedding(3, d)
        self.glob = nn.MultiheadAttention(d, 8, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, FUT * 3))

    def forward(self, b):
        ego = self.ego(b["ego_hist"][:, None]) + self.type_emb.weight[0]
        ag = self.agents(b["agents"]) + self.type_emb.weight[1]
        ln = self.lanes(b["lanes"]) + self.type_emb.weight[2]
        kv = torch.cat([ego, ag, ln], 1)
        pad = ~torch.cat([torch.ones_like(b["agents_mask"][:, :1]), b["agents_mask"], b["lanes_mask"]], 1)
        h = self.norm(ego + self.glob(ego, kv, kv, key_padding_mask=pad)[0])
        return self.head(h[:, 0]).view(-1, FUT, 3)


def plan_loss(pred, gt):
    w = torch.tensor([1.0, 1.0, 0.5], device=pred.device)
    return (F.smooth_l1_loss(pred, gt, reduction="none") * w).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--perturb-prob", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on every rank
    seed_everything(args.seed + rank)

    by_log = load_manifest(args.root)
    logs = sorted(by_log)
    random.shuffle(logs)
    n_val = max(1, int(len(logs) * args.val_fraction))
    val_logs, train_logs = logs[:n_val], logs[n_val:]
    train_tokens = [t for lg in train_logs for t in by_log[lg]]
    val_tokens = [t for lg in val_logs for t in by_log[lg]]
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        with open(os.path.join(args.save, "split.json"), "w") as f:
            json.dump({"train_logs": train_logs, "val_logs": val_logs}, f)
        print(f"{len(train_logs)} train logs ({len(train_tokens)} scenes), "
              f"{len(val_logs)} val logs ({len(val_tokens)} scenes)", flush=True)

    train_ds = ExportedScenarios(args.root, train_tokens, perturb_prob=args.perturb_prob)
    val_ds = ExportedScenarios(args.root, val_tokens)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=args.workers)

    model = DDP(VectorPlanner().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tr = torch.zeros(2, device=device)
        for b in train_dl:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss = plan_loss(model(b), b["ego_fut"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        model.eval()
        va = torch.zeros(4, device=device)
        with torch.no_grad():
            for b in val_dl:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                pred = model(b)
                err = (pred[..., :2] - b["ego_fut"][..., :2]).norm(dim=-1)
                va += torch.stack([err.mean(-1).sum(), err[:, -1].sum(), (err[:, -1] > 2.0).float().sum(),
                                   torch.tensor(float(len(err)), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        ade, fde, miss = (va[:3] / va[3].clamp(min=1)).tolist()
        if rank == 0:
            print(f"epoch {epoch}: train {(tr[0] / tr[1]).item():.4f}  val ADE {ade:.3f} FDE {fde:.3f} "
                  f"miss@2m {miss:.3f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.save, "last.pt"))
            if fde < best:
                best = fde
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.save, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
