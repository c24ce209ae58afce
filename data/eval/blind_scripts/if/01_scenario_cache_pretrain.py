#!/usr/bin/env python3
"""Agent-centric trajectory prediction on cached nuPlan scenario features.

Raw scenarios are exported from the nuPlan DBs as .npz (agents, map polylines,
ego pose). The first run featurizes them into a per-scenario .pt cache so later
runs only read tensors.

    torchrun --nproc_per_node=8 01_scenario_cache_pretrain.py \
        --scenario-root /data/nuplan/npz/trainval --cache-dir /data/nuplan/feature_cache/v3
"""
import argparse
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("cached_predictor")

HIST_STEPS = 21  # 2 s @ 10 Hz + current frame
FUT_STEPS = 80  # 8 s @ 10 Hz
MAX_AGENTS = 64
MAX_POLYLINES = 256
POINTS_PER_POLYLINE = 20


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--scenario-root", type=str, required=True)
    p.add_argument("--cache-dir", type=str, required=True)
    p.add_argument("--output-dir", type=str, default="./runs/cached_predictor")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=6e-4, help="for the global batch of 256")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--num-modes", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def _pad(arr, n, axis=0):
    if arr.shape[axis] >= n:
        return np.take(arr, np.arange(n), axis=axis)
    pad = [(0, 0)] * arr.ndim
    pad[axis] = (0, n - arr.shape[axis])
    return np.pad(arr, pad)


def featurize_scenario(path):
    raw = np.load(path, allow_pickle=True)
    agents = raw["agents"].astype(np.float32)  # [A, T, 7] x, y, yaw, vx, vy, length, width
    polylines = raw["map_polylines"].astype(np.float32)  # [P, N, 4] x, y, dir_x, dir_y
    valid = raw["agent_valid"].astype(np.bool_)  # [A, T]
    ego_pose = raw["ego_pose"].astype(np.float32)  # [3]

    # rotate into the ego frame at the current step
    c, s = math.cos(-ego_pose[2]), math.sin(-ego_pose[2])
    rot = np.array([[c, -s], [s, c]], dtype=np.float32)
    agents[..., :2] = (agents[..., :2] - ego_pose[:2]) @ rot.T
    agents[..., 3:5] = agents[..., 3:5] @ rot.T
    agents[..., 2] -= ego_pose[2]
    polylines[..., :2] = (polylines[..., :2] - ego_pose[:2]) @ rot.T
    polylines[..., 2:4] = polylines[..., 2:4] @ rot.T

    hist = agents[:, :HIST_STEPS]
    fut = agents[:, HIST_STEPS:HIST_STEPS + FUT_STEPS, :2]
    return {
        "hist": torch.from_numpy(_pad(hist, MAX_AGENTS)),
        "fut": torch.from_numpy(_pad(fut, MAX_AGENTS)),
        "fut_valid": torch.from_numpy(_pad(valid[:, HIST_STEPS:HIST_STEPS + FUT_STEPS], MAX_AGENTS)),
        "agent_mask": torch.from_numpy(_pad(valid[:, HIST_STEPS - 1], MAX_AGENTS)),
        "map": torch.from_numpy(_pad(_pad(polylines, POINTS_PER_POLYLINE, axis=1), MAX_POLYLINES)),
        "map_mask": torch.from_numpy(_pad(np.ones(len(polylines), dtype=np.bool_), MAX_POLYLINES)),
    }


def build_feature_cache(scenario_root, cache_dir):
    cache_dir = Path(cache_dir)
    index_file = cache_dir / "index.json"
    if index_file.exists():
        with open(index_file) as f:
            return json.load(f)

    cache_dir.mkdir(parents=True, exist_ok=True)
    files = sorted(Path(scenario_root).rglob("*.npz"))
    entries = []
    t0 = time.time()
    for i, path in enumerate(files):
        out = cache_dir / f"{path.stem}.pt"
        torch.save(featurize_scenario(path), out)
        entries.append(out.name)
        if i % 5000 == 0:
            logger.info("cached %d/%d scenarios (%.0fs)", i, len(files), time.time() - t0)
    with open(index_file, "w") as f:
        json.dump(entries, f)
    return entries


class CachedScenarioDataset(Dataset):
    def __init__(self, cache_dir, entries):
        self.cache_dir = Path(cache_dir)
        self.entries = entries

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, idx):
        return torch.load(self.cache_dir / self.entries[idx])


class PolylineEncoder(nn.Module):
    def __init__(self, in_dim, d_model):
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(in_dim, d_model), nn.LayerNorm(d_model), nn.ReLU())
        self.post = nn.Sequential(
            nn.Linear(2 * d_model, d_model), nn.LayerNorm(d_model), nn.ReLU(), nn.Linear(d_model, d_model)
        )

    def forward(self, pts):  # [B, P, N, C]
        x = self.pre(pts)
        pooled = x.max(dim=2, keepdim=True).values.expand_as(x)
        x = self.post(torch.cat([x, pooled], dim=-1))
        return x.max(dim=2).values


class MotionPredictor(nn.Module):
    def __init__(self, d_model=256, num_modes=6, depth=4):
        super().__init__()
        self.num_modes = num_modes
        self.agent_enc = nn.Sequential(
            nn.Linear(HIST_STEPS * 7, d_model), nn.ReLU(), nn.Linear(d_model, d_model)
        )
        self.map_enc = PolylineEncoder(4, d_model)
        self.token_type = nn.Embedding(2, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, 8, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.traj_head = nn.Sequential(
            nn.Linear(d_model, d_model), nn.ReLU(), nn.Linear(d_model, num_modes * FUT_STEPS * 2)
        )
        self.score_head = nn.Linear(d_model, num_modes)

    def forward(self, hist, agent_mask, map_pts, map_mask):
        B, A = hist.shape[:2]
        a = self.agent_enc(hist.flatten(2)) + self.token_type.weight[0]
        m = self.map_enc(map_pts) + self.token_type.weight[1]
        pad = ~torch.cat([agent_mask, map_mask], dim=1)
        x = self.encoder(torch.cat([a, m], dim=1), src_key_padding_mask=pad)[:, :A]
        traj = self.traj_head(x).view(B, A, self.num_modes, FUT_STEPS, 2)
        return traj, self.score_head(x)


def wta_loss(traj, scores, fut, fut_valid, agent_mask):
    valid = fut_valid & agent_mask[..., None]  # [B, A, T]
    err = (traj - fut[:, :, None]).norm(dim=-1)  # [B, A, K, T]
    vm = valid[:, :, None].float()
    ade = (err * vm).sum(-1) / vm.sum(-1).clamp(min=1)  # [B, A, K]
    best = ade.argmin(dim=-1)
    has = valid.any(-1)
    idx = best[..., None, None, None].expand(-1, -1, 1, FUT_STEPS, 2)
    best_traj = traj.gather(2, idx).squeeze(2)
    reg = F.smooth_l1_loss(best_traj, fut, reduction="none").sum(-1)
    reg = (reg * valid).sum() / valid.sum().clamp(min=1)
    cls = F.cross_entropy(scores.flatten(0, 1), best.flatten(), reduction="none")
    cls = (cls * has.flatten()).sum() / has.sum().clamp(min=1)
    return reg + cls, ade, has


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # sum minADE, sum minFDE, count
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        traj, scores = model(batch["hist"], batch["agent_mask"], batch["map"], batch["map_mask"])
        _, ade, has = wta_loss(traj, scores, batch["fut"], batch["fut_valid"], batch["agent_mask"])
        full = has & batch["fut_valid"][..., -1]
        fde = (traj[..., -1, :] - batch["fut"][:, :, None, -1]).norm(dim=-1).min(-1).values
        stats[0] += ade.min(-1).values[full].sum()
        stats[1] += fde[full].sum()
        stats[2] += full.sum()
    dist.all_reduce(stats)
    model.train()
    n = stats[2].clamp(min=1)
    return (stats[0] / n).item(), (stats[1] / n).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    entries = build_feature_cache(args.scenario_root, args.cache_dir)
    val_entries = entries[::20]
    train_entries = [e for i, e in enumerate(entries) if i % 20 != 0]
    train_ds = CachedScenarioDataset(args.cache_dir, train_entries)
    val_ds = CachedScenarioDataset(args.cache_dir, val_entries)
    logger.info("train %d / val %d scenarios", len(train_ds), len(val_ds))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world_size)))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, num_workers=args.workers,
                            pin_memory=True)

    model = MotionPredictor(args.d_model, args.num_modes, args.depth).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps,
                                                    pct_start=0.05)

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(args.output_dir)

    best_ade = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            traj, scores = model(batch["hist"], batch["agent_mask"], batch["map"], batch["map_mask"])
            loss, _, _ = wta_loss(traj, scores, batch["fut"], batch["fut_valid"], batch["agent_mask"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

        min_ade, min_fde = evaluate(model, val_loader, device)
        if rank == 0:
            logger.info("epoch %d  minADE %.3f  minFDE %.3f  (%.0fs)", epoch, min_ade, min_fde,
                        time.time() - t0)
            writer.add_scalar("val/minADE", min_ade, epoch)
            writer.add_scalar("val/minFDE", min_fde, epoch)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "minADE": min_ade}
            torch.save(ckpt, os.path.join(args.output_dir, "last.pt"))
            if min_ade < best_ade:
                best_ade = min_ade
                torch.save(ckpt, os.path.join(args.output_dir, "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
