"""CGCNN-style band gap regression on Materials Project structures.

Crystal graphs are built on the GPU every step (periodic radius graph), so the
dataset only stores atomic numbers, fractional->cartesian positions and the lattice.

Launch (1 node, 4 GPUs):
    torchrun --nproc_per_node=4 05_mp_cgcnn_bandgap.py --data mp_2023_bandgap.json.gz
"""
import argparse
import gzip
import itertools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pymatgen.core import Structure
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


class MPBandGap(Dataset):
    def __init__(self, path):
        with gzip.open(path, "rt") as f:
            records = json.load(f)
        self.items = []
        for r in records:
            s = Structure.from_dict(r["structure"])
            self.items.append((
                np.array(s.atomic_numbers, dtype=np.int64),
                s.cart_coords.astype(np.float32),
                s.lattice.matrix.astype(np.float32),
                float(r["band_gap"]),
                r["material_id"],
            ))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        z, pos, lattice, gap, _ = self.items[i]
        return Data(z=torch.from_numpy(z), pos=torch.from_numpy(pos),
                    cell=torch.from_numpy(lattice).unsqueeze(0), natoms=torch.tensor([len(z)]),
                    y=torch.tensor([gap], dtype=torch.float32))


_OFFSETS = list(itertools.product((-1, 0, 1), repeat=3))


@torch.no_grad()
def periodic_radius_graph(pos, cell, natoms, cutoff):
    dev = pos.device
    offsets = torch.tensor(_OFFSETS, device=dev, dtype=pos.dtype)
    ptr = torch.cat([natoms.new_zeros(1), natoms.cumsum(0)])
    src_all, dst_all, off_all = [], [], []
    for g in range(natoms.numel()):  # crystals are small (<= 64 atoms in this set)
        p = pos[ptr[g]:ptr[g + 1]]
        shift = offsets @ cell[g]                                    # [27, 3]
        diff = p.unsqueeze(0).unsqueeze(0) + shift[:, None, None, :] - p.unsqueeze(1).unsqueeze(0)  # [27, n, n, 3]
        d = diff.norm(dim=-1)
        img, i, j = torch.nonzero((d < cutoff) & (d > 1e-5), as_tuple=True)
        src_all.append(j + ptr[g])
        dst_all.append(i + ptr[g])
        off_all.append(shift[img])
    return torch.stack([torch.cat(src_all), torch.cat(dst_all)]), torch.cat(off_all)


class CGConv(nn.Module):
    def __init__(self, dim, edge_dim):
        super().__init__()
        self.lin = nn.Linear(2 * dim + edge_dim, 2 * dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, h, edge_index, e):
        src, dst = edge_index
        zf, zs = self.lin(torch.cat([h[dst], h[src], e], dim=-1)).chunk(2, dim=-1)
        msg = torch.sigmoid(zf) * F.softplus(zs)
        return F.softplus(h + self.norm(scatter(msg, dst, dim=0, dim_size=h.size(0))))


class CGCNN(nn.Module):
    def __init__(self, dim=128, n_conv=4, n_gauss=64, cutoff=8.0):
        super().__init__()
        self.cutoff = cutoff
        self.emb = nn.Embedding(100, dim)
        self.register_buffer("mu", torch.linspace(0, cutoff, n_gauss))
        self.convs = nn.ModuleList(CGConv(dim, n_gauss) for _ in range(n_conv))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.Softplus(), nn.Linear(dim, 1))

    def forward(self, data):
        edge_index, shift = periodic_radius_graph(data.pos, data.cell, data.natoms, self.cutoff)
        d = (data.pos[edge_index[0]] + shift - data.pos[edge_index[1]]).norm(dim=-1)
        e = torch.exp(-((d.unsqueeze(-1) - self.mu) ** 2) / (self.mu[1] - self.mu[0]) ** 2)
        h = self.emb(data.z)
        for conv in self.convs:
            h = conv(h, edge_index, e)
        return self.head(scatter(h, data.batch, dim=0, reduce="mean")).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    abs_err, sq_err, n = 0.0, 0.0, 0
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch).clamp(min=0.0)
        abs_err += (pred - batch.y).abs().sum().item()
        sq_err += ((pred - batch.y) ** 2).sum().item()
        n += batch.num_graphs
    totals = torch.tensor([abs_err, sq_err, n], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals[0].item() / totals[2].item(), math.sqrt(totals[1].item() / totals[2].item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--split", type=float, nargs=3, default=[0.8, 0.1, 0.1])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt_dir", default="ckpt_cgcnn")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    dataset = MPBandGap(args.data)
    n = len(dataset)
    perm = np.random.RandomState(args.seed).permutation(n)
    n_tr, n_va = int(args.split[0] * n), int(args.split[1] * n)
    train_set = Subset(dataset, perm[:n_tr].tolist())
    val_set = Subset(dataset, perm[n_tr:n_tr + n_va].tolist()[rank::world])
    test_set = Subset(dataset, perm[n_tr + n_va:].tolist()[rank::world])

    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=128, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=128, num_workers=2)

    torch.manual_seed(args.seed)
    model = DDP(CGCNN().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(0.6 * args.epochs), int(0.85 * args.epochs)], gamma=0.1)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best = float("inf")
    best_path = os.path.join(args.ckpt_dir, "best.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            loss = F.l1_loss(model(batch), batch.y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        val_mae, val_rmse = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} val MAE {val_mae:.4f} eV RMSE {val_rmse:.4f} eV ({time.time() - t0:.1f}s)", flush=True)
            if val_mae < best:
                best = val_mae
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_mae": val_mae}, best_path)
        dist.barrier()

    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_mae, test_rmse = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']}: test MAE {test_mae:.4f} eV, RMSE {test_rmse:.4f} eV")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
