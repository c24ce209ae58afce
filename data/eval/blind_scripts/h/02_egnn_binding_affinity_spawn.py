"""
E(n)-equivariant GNN for protein-ligand binding affinity (PDBbind refined set).

Single node, one process per GPU via torch.multiprocessing:

    python 02_egnn_binding_affinity_spawn.py --data data/pdbbind_pocket10.pt --gpus 8

The pocket graphs are pre-extracted (10 A around the ligand) into a list of
dicts {pos, z, is_ligand, y} by scripts/extract_pockets.py.
"""
import argparse
import math
import os
import random
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NUM_ELEMENTS = 64


class PocketDataset(Dataset):
    def __init__(self, path, split, split_file):
        graphs = torch.load(path, map_location="cpu")
        ids = [l.strip() for l in open(split_file)] if split_file else None
        if ids is not None:
            keep = set(ids)
            graphs = [g for g in graphs if (g["pdb_id"] in keep) == (split != "train")]
        self.graphs = graphs

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def collate_graphs(batch, cutoff=5.0):
    pos, z, lig, y, batch_idx = [], [], [], [], []
    edges, offset = [], 0
    for b, g in enumerate(batch):
        n = g["pos"].shape[0]
        d = torch.cdist(g["pos"], g["pos"])
        src, dst = torch.nonzero((d < cutoff) & (d > 0), as_tuple=True)
        edges.append(torch.stack([src, dst]) + offset)
        pos.append(g["pos"]); z.append(g["z"]); lig.append(g["is_ligand"])
        y.append(torch.tensor([g["y"]], dtype=torch.float32))
        batch_idx.append(torch.full((n,), b, dtype=torch.long))
        offset += n
    return {"pos": torch.cat(pos), "z": torch.cat(z), "is_ligand": torch.cat(lig).float(),
            "edge_index": torch.cat(edges, dim=1), "batch": torch.cat(batch_idx),
            "y": torch.cat(y), "num_graphs": len(batch)}


class EGNNLayer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden + 1, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden), nn.SiLU())
        self.coord_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h, x, edge_index):
        src, dst = edge_index
        rel = x[src] - x[dst]
        dist2 = (rel ** 2).sum(-1, keepdim=True)
        m = self.edge_mlp(torch.cat([h[src], h[dst], dist2], dim=-1))
        w = self.coord_mlp(m)
        deg = torch.zeros(x.shape[0], 1, device=x.device).index_add_(0, dst, torch.ones_like(w))
        x = x + torch.zeros_like(x).index_add_(0, dst, rel * w) / deg.clamp(min=1)
        agg = torch.zeros_like(h).index_add_(0, dst, m)
        h = self.norm(h + self.node_mlp(torch.cat([h, agg], dim=-1)))
        return h, x


class EGNNAffinity(nn.Module):
    def __init__(self, hidden=128, layers=6):
        super().__init__()
        self.embed = nn.Embedding(NUM_ELEMENTS, hidden)
        self.lig_proj = nn.Linear(1, hidden)
        self.layers = nn.ModuleList([EGNNLayer(hidden) for _ in range(layers)])
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, z, pos, is_ligand, edge_index, batch, num_graphs):
        h = self.embed(z) + self.lig_proj(is_ligand.unsqueeze(-1))
        x = pos
        for layer in self.layers:
            h, x = layer(h, x, edge_index)
        pooled = torch.zeros(num_graphs, h.shape[1], device=h.device).index_add_(0, batch, h)
        return self.head(pooled).squeeze(-1)


def to_device(batch, device):
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)   # sse, sum|err|, count
    for batch in loader:
        batch = to_device(batch, device)
        pred = model(batch["z"], batch["pos"], batch["is_ligand"], batch["edge_index"],
                     batch["batch"], batch["num_graphs"])
        err = pred - batch["y"]
        sums += torch.stack([err.pow(2).sum(), err.abs().sum(), torch.tensor(float(err.numel()), device=device)])
    dist.all_reduce(sums)
    return math.sqrt(sums[0] / sums[2]), (sums[1] / sums[2]).item()


def worker(cfg, rank):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=cfg.world_size)
    device = torch.device("cuda", rank)

    random.seed(cfg.seed); np.random.seed(cfg.seed); torch.manual_seed(cfg.seed)

    train_set = PocketDataset(cfg.data, "train", cfg.split_file)
    val_set = PocketDataset(cfg.data, "val", cfg.split_file)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              collate_fn=collate_graphs, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, sampler=val_sampler,
                            collate_fn=collate_graphs, num_workers=4)

    model = EGNNAffinity(cfg.hidden, cfg.layers).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr * cfg.world_size, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr * cfg.world_size,
                                                total_steps=cfg.epochs * len(train_loader))
    best = float("inf")

    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = to_device(batch, device)
            pred = model(batch["z"], batch["pos"], batch["is_ligand"], batch["edge_index"],
                         batch["batch"], batch["num_graphs"])
            loss = nn.functional.smooth_l1_loss(pred, batch["y"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach() * batch["num_graphs"],
                                     torch.tensor(float(batch["num_graphs"]), device=device)])
        dist.all_reduce(loss_sum)
        rmse, mae = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} train_loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val_rmse {rmse:.3f} val_mae {mae:.3f}", flush=True)
            if rmse < best:
                best = rmse
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "rmse": rmse},
                           os.path.join(cfg.out_dir, "egnn_best.pt"))

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/pdbbind_pocket10.pt")
    p.add_argument("--split-file", default="data/pdbbind_core_ids.txt")
    p.add_argument("--out-dir", default="checkpoints/egnn")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--port", type=int, default=29511)
    a = p.parse_args()
    return SimpleNamespace(**vars(a), world_size=a.gpus)


if __name__ == "__main__":
    cfg = parse_args()
    os.makedirs(cfg.out_dir, exist_ok=True)
    mp.spawn(worker, args=(cfg,), nprocs=cfg.world_size, join=True)
