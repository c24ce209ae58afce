#!/usr/bin/env python3
"""SchNet force field on MD17 with precomputed neighbour lists.

Neighbour lists for all frames are built once with the chosen cutoff and
cached next to the raw npz, so later runs start immediately.

    torchrun --standalone --nproc_per_node=4 06_schnet_md17_cached_graphs.py \
        --npz data/md17/md17_malonaldehyde.npz --cutoff 5.0
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm


def build_graphs(npz_path, cutoff):
    raw = np.load(npz_path)
    z = torch.as_tensor(raw["z"], dtype=torch.long)
    R = torch.as_tensor(raw["R"], dtype=torch.float32)
    E = torch.as_tensor(raw["E"], dtype=torch.float64).view(-1)
    Fr = torch.as_tensor(raw["F"], dtype=torch.float32)
    edges = []
    for r in tqdm(R, desc="neighbour lists", mininterval=5):
        d = torch.cdist(r, r)
        mask = (d < cutoff) & ~torch.eye(len(r), dtype=torch.bool)
        edges.append(mask.nonzero().t().contiguous())
    return {"z": z, "R": R, "E": E, "F": Fr, "edges": edges, "cutoff": cutoff}


def load_graphs(npz_path, cutoff):
    cache = os.path.splitext(npz_path)[0] + f"_graphs_c{cutoff:.1f}.pt"
    if not os.path.exists(cache):
        graphs = build_graphs(npz_path, cutoff)
        torch.save(graphs, cache)
    else:
        graphs = torch.load(cache)
    return graphs


class MD17Frames(Dataset):
    def __init__(self, graphs):
        self.g = graphs

    def __len__(self):
        return len(self.g["E"])

    def __getitem__(self, i):
        return self.g["z"], self.g["R"][i], self.g["E"][i], self.g["F"][i], self.g["edges"][i]


def collate(items):
    zs, pos, energy, forces, edges, batch = [], [], [], [], [], []
    offset = 0
    for k, (z, r, e, f, ei) in enumerate(items):
        zs.append(z)
        pos.append(r)
        energy.append(e)
        forces.append(f)
        edges.append(ei + offset)
        batch.append(torch.full((len(z),), k, dtype=torch.long))
        offset += len(z)
    return {"z": torch.cat(zs), "pos": torch.cat(pos), "energy": torch.stack(energy).float(),
            "forces": torch.cat(forces), "edge_index": torch.cat(edges, dim=1), "batch": torch.cat(batch),
            "num_graphs": len(items)}


def ssp(x):
    return F.softplus(x) - math.log(2.0)


class CFConv(nn.Module):
    def __init__(self, hidden, n_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.mlp = nn.Sequential(nn.Linear(n_rbf, hidden), nn.Softplus(), nn.Linear(hidden, hidden))
        self.lin1 = nn.Linear(hidden, hidden, bias=False)
        self.lin2 = nn.Linear(hidden, hidden)
        self.lin3 = nn.Linear(hidden, hidden)

    def forward(self, h, edge_index, d, rbf):
        i, j = edge_index
        W = self.mlp(rbf) * (0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)).unsqueeze(-1)
        x = self.lin1(h)
        agg = torch.zeros_like(x).index_add_(0, i, x[j] * W)
        return h + self.lin3(ssp(self.lin2(agg)))


class SchNet(nn.Module):
    def __init__(self, hidden=64, n_rbf=25, n_interactions=3, cutoff=5.0, mean=0.0, std=1.0):
        super().__init__()
        self.emb = nn.Embedding(10, hidden)
        self.register_buffer("mu", torch.linspace(0, cutoff, n_rbf))
        self.gamma = 10.0
        self.convs = nn.ModuleList([CFConv(hidden, n_rbf, cutoff) for _ in range(n_interactions)])
        self.out1 = nn.Linear(hidden, hidden // 2)
        self.out2 = nn.Linear(hidden // 2, 1)
        self.register_buffer("mean", torch.tensor(mean))
        self.register_buffer("std", torch.tensor(std))

    def forward(self, z, pos, edge_index, batch, num_graphs):
        pos.requires_grad_(True)
        i, j = edge_index
        d = (pos[i] - pos[j]).norm(dim=-1)
        rbf = torch.exp(-self.gamma * (d.unsqueeze(-1) - self.mu) ** 2)
        h = self.emb(z)
        for conv in self.convs:
            h = conv(h, edge_index, d, rbf)
        e_atom = self.out2(ssp(self.out1(h))).squeeze(-1) * self.std + self.mean
        energy = torch.zeros(num_graphs, device=pos.device, dtype=e_atom.dtype).index_add_(0, batch, e_atom)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def to_device(b, device):
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in b.items()}


def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, dtype=torch.float64, device=device)
    for b in loader:
        b = to_device(b, device)
        e, f = model(b["z"], b["pos"], b["edge_index"], b["batch"], b["num_graphs"])
        s[0] += (e.detach() - b["energy"]).abs().sum()
        s[1] += (f.detach() - b["forces"]).abs().sum()
        s[2] += b["num_graphs"]
        s[3] += b["forces"].numel()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npz", required=True)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--n-val", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rho", type=float, default=0.01, help="energy weight; forces get 1 - rho")
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--ckpt", default="checkpoints/schnet_md17.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    graphs = load_graphs(args.npz, args.cutoff)
    ds = MD17Frames(graphs)
    perm = np.random.RandomState(0).permutation(len(ds))
    tr, va, te = perm[:args.n_train], perm[args.n_train:args.n_train + args.n_val], perm[args.n_train + args.n_val:]
    train_set = Subset(ds, tr)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=collate, num_workers=2, pin_memory=True)
    val_loader = DataLoader(Subset(ds, va[rank::world]), batch_size=100, collate_fn=collate)
    test_loader = DataLoader(Subset(ds, te[rank::world]), batch_size=100, collate_fn=collate)

    n_atoms = len(graphs["z"])
    e_train = graphs["E"][torch.as_tensor(tr)]
    mean = float(e_train.mean() / n_atoms)
    std = float(graphs["F"][torch.as_tensor(tr)].std())
    model = SchNet(cutoff=args.cutoff, mean=mean, std=std).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=25, min_lr=1e-6)

    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t = time.time()
        for b in train_loader:
            b = to_device(b, device)
            e, f = model(b["z"], b["pos"], b["edge_index"], b["batch"], b["num_graphs"])
            loss = args.rho * F.mse_loss(e, b["energy"]) + (1 - args.rho) * F.mse_loss(f, b["forces"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        e_mae, f_mae = evaluate(model.module, val_loader, device)
        sched.step(args.rho * e_mae + (1 - args.rho) * f_mae)
        if rank == 0:
            print(f"epoch {epoch} | val E {e_mae:.4f} F {f_mae:.4f} kcal/mol | "
                  f"lr {opt.param_groups[0]['lr']:.1e} | {time.time() - t:.1f}s", flush=True)
            if f_mae < best:
                best = f_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.ckpt)
        dist.barrier()
        if opt.param_groups[0]["lr"] <= 1e-6:
            break

    model.module.load_state_dict(torch.load(args.ckpt, map_location=device)["model"])
    e_mae, f_mae = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"TEST  energy MAE {e_mae:.4f} kcal/mol  force MAE {f_mae:.4f} kcal/mol/A")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
