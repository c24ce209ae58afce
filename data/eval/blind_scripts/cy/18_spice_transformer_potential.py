"""Equivariant-attention potential on SPICE (HDF5), energy + forces, DDP.

Energies are fitted as formation energies (total DFT energy minus the
per-element reference energies), forces are -dE/dx.

    torchrun --nproc_per_node=8 18_spice_transformer_potential.py --h5 /data/spice/SPICE-1.1.4.hdf5
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter

BOHR = 0.529177210903
HARTREE_EV = 27.211386246
ELEMENT_INDEX = {1: 0, 3: 1, 6: 2, 7: 3, 8: 4, 9: 5, 11: 6, 12: 7, 15: 8, 16: 9, 17: 10, 19: 11, 20: 12, 35: 13, 53: 14}
# wB97M-D3(BJ)/def2-TZVPPD isolated-atom energies (Hartree), neutral atoms
ATOM_ENERGY = {1: -0.4987605, 3: -7.4762059, 6: -37.8462793, 7: -54.5844894, 8: -75.0621162, 9: -99.7287289,
               11: -162.2831036, 12: -200.0689966, 15: -341.2580847, 16: -398.1049943, 17: -460.1373832,
               19: -599.9122832, 20: -677.0949153, 35: -2574.1167240, 53: -297.7634748}


class SpiceConformers(Dataset):
    def __init__(self, path, max_atoms=110):
        self.items = []
        with h5py.File(path, "r") as f:
            for name in sorted(f.keys()):
                g = f[name]
                z = g["atomic_numbers"][()]
                if len(z) > max_atoms or any(int(a) not in ELEMENT_INDEX for a in z):
                    continue
                ref = sum(ATOM_ENERGY[int(a)] for a in z)
                R = g["conformations"][()] * BOHR
                E = (g["dft_total_energy"][()] - ref) * HARTREE_EV
                G = g["dft_total_gradient"][()] * HARTREE_EV / BOHR
                species = np.array([ELEMENT_INDEX[int(a)] for a in z])
                for k in range(len(E)):
                    self.items.append((species, R[k].astype(np.float32), float(E[k]), (-G[k]).astype(np.float32)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, r, e, f = self.items[i]
        return Data(species=torch.from_numpy(s), pos=torch.from_numpy(r), energy=torch.tensor([e]),
                    force=torch.from_numpy(f))


class ExpNormalRBF(nn.Module):
    def __init__(self, cutoff, n):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("means", torch.linspace(math.exp(-cutoff), 1.0, n))
        self.register_buffer("betas", torch.full((n,), (2 / n * (1 - math.exp(-cutoff))) ** -2))

    def forward(self, d):
        fc = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        return fc.unsqueeze(-1) * torch.exp(-self.betas * (torch.exp(-d).unsqueeze(-1) - self.means) ** 2)


class EquivariantAttention(nn.Module):
    def __init__(self, dim, heads, n_rbf):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.dk = nn.Linear(n_rbf, dim)
        self.dv = nn.Linear(n_rbf, 3 * dim)
        self.vec_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, 3 * dim)

    def forward(self, x, vec, edge_index, rbf, unit, fc):
        j, i = edge_index
        h = self.heads
        q, k, v = self.qkv(self.norm(x)).split(self.dim, dim=-1)
        attn = (q[i] * k[j] * self.dk(rbf)).view(-1, h, self.dim // h).sum(-1)
        attn = nn.functional.silu(attn) * fc.unsqueeze(-1)
        v = v[j].view(-1, h, self.dim // h) * attn.unsqueeze(-1)
        s1, s2, s3 = (v.view(-1, self.dim).repeat(1, 3) * self.dv(rbf)).split(self.dim, dim=-1)
        dvec = vec[j] * s1.unsqueeze(1) + s2.unsqueeze(1) * unit.unsqueeze(-1)
        x_agg = scatter(s3, i, dim=0, dim_size=x.size(0))
        vec_agg = scatter(dvec, i, dim=0, dim_size=x.size(0))
        v1, v2, v3 = self.vec_proj(vec).split(self.dim, dim=-1)
        o1, o2, o3 = self.out(x_agg).split(self.dim, dim=-1)
        dx = (v1 * v2).sum(1) * o2 + o3
        return x + dx, vec + v3 * o1.unsqueeze(1) + vec_agg


class Potential(nn.Module):
    def __init__(self, dim=256, layers=6, heads=8, n_rbf=32, cutoff=5.0, max_neighbors=48):
        super().__init__()
        self.cutoff = cutoff
        self.max_neighbors = max_neighbors
        self.embed = nn.Embedding(len(ELEMENT_INDEX), dim)
        self.rbf = ExpNormalRBF(cutoff, n_rbf)
        self.layers = nn.ModuleList([EquivariantAttention(dim, heads, n_rbf) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim // 2), nn.SiLU(), nn.Linear(dim // 2, 1))
        self.elem_shift = nn.Embedding(len(ELEMENT_INDEX), 1)
        nn.init.zeros_(self.elem_shift.weight)

    def forward(self, species, pos, edge_index, batch, num_graphs):
        j, i = edge_index
        rij = pos[j] - pos[i]
        d = rij.norm(dim=-1)
        unit = rij / d.unsqueeze(-1)
        rbf, fc = self.rbf(d), 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        x = self.embed(species)
        vec = x.new_zeros(x.size(0), 3, x.size(1))
        for layer in self.layers:
            x, vec = layer(x, vec, edge_index, rbf, unit, fc)
        e = self.head(x).squeeze(-1) + self.elem_shift(species).squeeze(-1)
        return scatter(e, batch, dim=0, dim_size=num_graphs)


def energy_and_forces(model, net, data, create_graph):
    pos = data.pos.requires_grad_(True)
    edge_index = radius_graph(pos, r=net.cutoff, batch=data.batch, max_num_neighbors=net.max_neighbors)
    energy = model(data.species, pos, edge_index, data.batch, data.num_graphs)
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=create_graph)[0]
    return energy, forces


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True)
    ap.add_argument("--out", default="runs/spice_et")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--force-weight", type=float, default=100.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = SpiceConformers(args.h5)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = int(args.val_fraction * len(ds))
    train_set = torch.utils.data.Subset(ds, perm[n_val:])
    val_set = torch.utils.data.Subset(ds, perm[:n_val][rank::world])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=64, num_workers=2)

    model = DDP(Potential().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=5, min_lr=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train / {n_val} val conformers on {world} GPUs", flush=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            e, f = energy_and_forces(model, model, data, create_graph=True)
            loss = nn.functional.mse_loss(e, data.energy) + args.force_weight * nn.functional.mse_loss(f, data.force)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            if step < warmup:
                sched.step()
            step += 1

        net = model.module.eval()
        s = torch.zeros(4, dtype=torch.float64, device=device)
        for data in val_loader:
            data = data.to(device)
            e, f = energy_and_forces(net, net, data, create_graph=False)
            s[0] += (e.detach() - data.energy).abs().sum()
            s[1] += (f.detach() - data.force).abs().sum()
            s[2] += data.num_graphs
            s[3] += data.force.numel()
        dist.all_reduce(s)
        e_mae, f_mae = (s[0] / s[2]).item(), (s[1] / s[3]).item()
        if step >= warmup:
            plateau.step(f_mae)
        if rank == 0:
            print(f"epoch {epoch}: val E MAE {e_mae * 1000:.1f} meV  F MAE {f_mae * 1000:.1f} meV/A  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
