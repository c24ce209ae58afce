"""PDM-Open-style learned planner: an MLP over the ego history and the centerline of the route,
trained on a single 8-GPU workstation with torch.multiprocessing.spawn.

Samples are bucketed by centerline length so that batches are dense; the buckets make the number
of batches differ a little between ranks, which DDP's join handles.

    python 17_spawn_pdm_learner.py --data /ssd/nuplan/pdm_open_cache --gpus 8 --out runs/pdm_open
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

HIST = 20
PLAN = 16
CENTERLINE_PTS = (60, 120, 240)  # buckets (0.5 m, 1 m, 2 m spacing variants)


class PDMCache(Dataset):
    def __init__(self, root, split):
        meta = np.load(os.path.join(root, f"{split}_meta.npz"))
        self.files = [os.path.join(root, split, f) for f in meta["files"]]
        self.bucket = meta["bucket"]  # index into CENTERLINE_PTS

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        return {
            "ego_hist": torch.from_numpy(d["ego_history"].astype(np.float32)),  # [20, 7]
            "centerline": torch.from_numpy(d["centerline"].astype(np.float32)),  # [P, 3]
            "plan": torch.from_numpy(d["expert_plan"].astype(np.float32)),  # [16, 3]
        }


class RankBucketSampler(Sampler):
    """Shards the dataset across ranks (same permutation everywhere), then batches within buckets."""

    def __init__(self, buckets, batch_size, rank, world_size, seed=0, shuffle=True):
        self.buckets = np.asarray(buckets)
        self.batch_size, self.rank, self.world = batch_size, rank, world_size
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        g = np.random.default_rng(self.seed + self.epoch)
        idx = g.permutation(len(self.buckets)) if self.shuffle else np.arange(len(self.buckets))
        mine = idx[self.rank::self.world]
        batches = []
        for b in np.unique(self.buckets):
            sel = mine[self.buckets[mine] == b]
            batches += [sel[i:i + self.batch_size].tolist() for i in range(0, len(sel), self.batch_size)]
        if self.shuffle:
            random.Random(self.seed + self.epoch + self.rank).shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class PDMOpen(nn.Module):
    def __init__(self, hidden=512):
        super().__init__()
        self.state_enc = nn.Sequential(nn.Linear(HIST * 7, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.line_pt = nn.Sequential(nn.Linear(3, hidden // 2), nn.ReLU(), nn.Linear(hidden // 2, hidden))
        self.line_pool = nn.AdaptiveMaxPool1d(16)
        self.line_proj = nn.Linear(16 * hidden, hidden)
        self.planner = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                     nn.ReLU(), nn.Linear(hidden, PLAN * 3))

    def forward(self, ego_hist, centerline):
        s = self.state_enc(ego_hist.flatten(1))
        c = self.line_pt(centerline).transpose(1, 2)  # [B, hidden, P]
        c = self.line_proj(self.line_pool(c).flatten(1))
        return self.planner(torch.cat([s, c], -1)).view(-1, PLAN, 3)


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_set, val_set = PDMCache(args.data, "train"), PDMCache(args.data, "val")
    train_sampler = RankBucketSampler(train_set.bucket, args.batch_size, rank, world_size, seed=args.seed)
    val_sampler = RankBucketSampler(val_set.bucket, args.batch_size, rank, world_size, shuffle=False)
    train_loader = DataLoader(train_set, batch_sampler=train_sampler, num_workers=args.workers, pin_memory=True)
    val_loader = DataLoader(val_set, batch_sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    model = DDP(PDMOpen(args.hidden).to(device), device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        # ranks may hold one or two batches more than others; join shadows their all-reduces
        with Join([model]):
            for b in train_loader:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                pred = model(b["ego_hist"], b["centerline"])
                loss = F.l1_loss(pred, b["plan"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                meter += torch.stack([loss.detach() * len(pred), torch.tensor(float(len(pred)), device=device)])
        scheduler.step()

        model.eval()
        ev = torch.zeros(3, device=device)
        with torch.no_grad():
            for b in val_loader:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                pred = model.module(b["ego_hist"], b["centerline"])
                d = (pred[..., :2] - b["plan"][..., :2]).norm(dim=-1)
                ev += torch.stack([d.mean(-1).sum(), d[:, -1].sum(), torch.tensor(float(len(d)), device=device)])
        dist.all_reduce(meter)
        dist.all_reduce(ev)
        ade, fde = (ev[0] / ev[2]).item(), (ev[1] / ev[2]).item()
        if rank == 0:
            print(f"epoch {epoch:02d} train L1 {(meter[0] / meter[1]).item():.4f} val ADE {ade:.3f} "
                  f"FDE {fde:.3f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if fde < best:
                best = fde
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/pdm_open")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="for all GPUs together (per-GPU batch 64 x 8)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
