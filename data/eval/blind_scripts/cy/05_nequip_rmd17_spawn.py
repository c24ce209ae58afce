"""Small NequIP-style E(3)-equivariant potential on rMD17, multi-GPU via mp.spawn.

    python 05_nequip_rmd17_spawn.py --npz data/rmd17/npz_data/rmd17_ethanol.npz --gpus 4
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from e3nn import o3
from e3nn.math import soft_one_hot_linspace
from e3nn.nn import FullyConnectedNet, Gate
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter

KCAL_TO_MEV = 43.364


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--npz", required=True)
    p.add_argument("--splits", default="data/rmd17/splits/index_train_01.csv")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--out", default="runs/nequip_rmd17")
    p.add_argument("--n-train", type=int, default=950)
    p.add_argument("--n-val", type=int, default=50)
    p.add_argument("--lmax", type=int, default=2)
    p.add_argument("--mul", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cutoff", type=float, default=4.0)
    p.add_argument("--n-basis", type=int, default=8)
    p.add_argument("--avg-neighbors", type=float, default=8.0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--force-weight", type=float, default=1000.0)
    p.add_argument("--port", default="29513")
    return p.parse_args()


def load_rmd17(path):
    raw = np.load(path)
    z = torch.from_numpy(raw["nuclear_charges"]).long()
    frames = []
    for r, e, f in zip(raw["coords"], raw["energies"], raw["forces"]):
        frames.append(Data(z=z, pos=torch.from_numpy(r).float(),
                           energy=torch.tensor([e], dtype=torch.float32),
                           force=torch.from_numpy(f).float()))
    return frames


class Interaction(nn.Module):
    def __init__(self, irreps_in, irreps_sh, irreps_hidden, n_basis, avg_neighbors, last=False):
        super().__init__()
        self.avg_neighbors = avg_neighbors
        scalars = o3.Irreps([(m, ir) for m, ir in irreps_hidden if ir.l == 0])
        gated = o3.Irreps([(m, ir) for m, ir in irreps_hidden if ir.l > 0])
        if last:
            irreps_out = scalars
            self.gate = None
            self.act = nn.SiLU()
        else:
            gates = o3.Irreps(f"{gated.num_irreps}x0e")
            self.gate = Gate(scalars, [torch.nn.functional.silu], gates, [torch.sigmoid], gated)
            irreps_out = self.gate.irreps_in
        self.tp = o3.FullyConnectedTensorProduct(irreps_in, irreps_sh, irreps_out, shared_weights=False)
        self.radial = FullyConnectedNet([n_basis, 64, 64, self.tp.weight_numel], torch.nn.functional.silu)
        self.self_int = o3.Linear(irreps_in, irreps_out)
        self.irreps_out = self.gate.irreps_out if self.gate is not None else irreps_out

    def forward(self, x, edge_index, sh, emb):
        src, dst = edge_index
        msg = self.tp(x[src], sh, self.radial(emb))
        agg = scatter(msg, dst, dim=0, dim_size=x.size(0), reduce="sum") / math.sqrt(self.avg_neighbors)
        out = self.self_int(x) + agg
        return self.gate(out) if self.gate is not None else self.act(out)


class NequIPLike(nn.Module):
    def __init__(self, num_species, mul, lmax, layers, cutoff, n_basis, avg_neighbors, e_shift, f_scale):
        super().__init__()
        self.cutoff, self.n_basis = cutoff, n_basis
        self.irreps_sh = o3.Irreps.spherical_harmonics(lmax)
        hidden = o3.Irreps("+".join(f"{mul}x{l}{p}" for l in range(lmax + 1) for p in ("e", "o")
                                    if l == 0 and p == "e" or l > 0))
        irreps = o3.Irreps(f"{mul}x0e")
        self.embed = nn.Embedding(num_species, mul)
        self.layers = nn.ModuleList()
        for k in range(layers):
            layer = Interaction(irreps, self.irreps_sh, hidden, n_basis, avg_neighbors, last=(k == layers - 1))
            self.layers.append(layer)
            irreps = layer.irreps_out
        self.readout = o3.Linear(irreps, "1x0e")
        self.register_buffer("e_shift", torch.tensor(e_shift))
        self.register_buffer("f_scale", torch.tensor(f_scale))

    def forward(self, data):
        pos = data.pos.requires_grad_(True)
        edge_index = radius_graph(pos, self.cutoff, data.batch, max_num_neighbors=64)
        src, dst = edge_index
        vec = pos[src] - pos[dst]
        d = vec.norm(dim=-1)
        sh = o3.spherical_harmonics(self.irreps_sh, vec, normalize=True, normalization="component")
        emb = soft_one_hot_linspace(d, 0.0, self.cutoff, self.n_basis, basis="bessel", cutoff=True)
        emb = emb * math.sqrt(self.n_basis)
        x = self.embed(data.species)
        for layer in self.layers:
            x = layer(x, edge_index, sh, emb)
        e_atom = self.readout(x).squeeze(-1) * self.f_scale
        energy = scatter(e_atom, data.batch, dim=0, dim_size=data.num_graphs) + self.e_shift
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def train_worker(cfg, rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = cfg.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    frames = load_rmd17(cfg.npz)
    species = sorted(set(frames[0].z.tolist()))
    to_idx = {z: i for i, z in enumerate(species)}
    for fr in frames:
        fr.species = torch.tensor([to_idx[z] for z in fr.z.tolist()])
    train_idx = np.loadtxt(cfg.splits, dtype=int)
    rest = np.setdiff1d(np.arange(len(frames)), train_idx)
    train = [frames[i] for i in train_idx[:cfg.n_train]]
    val = [frames[i] for i in train_idx[cfg.n_train:cfg.n_train + cfg.n_val]]
    test = [frames[i] for i in rest]

    e_shift = float(torch.cat([f.energy for f in train]).mean())
    f_scale = float(torch.cat([f.force for f in train]).pow(2).mean().sqrt())

    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train, batch_size=cfg.batch_size, sampler=sampler)
    val_loader = DataLoader(val[rank::world_size], batch_size=16)
    test_loader = DataLoader(test[rank::world_size], batch_size=16)

    model = NequIPLike(len(species), cfg.mul, cfg.lmax, cfg.layers, cfg.cutoff, cfg.n_basis,
                       avg_neighbors=cfg.avg_neighbors, e_shift=e_shift, f_scale=f_scale).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=50)

    def run_eval(loader):
        net = model.module.eval()
        acc = torch.zeros(4, device=device, dtype=torch.float64)
        for data in loader:
            data = data.to(device)
            e, f = net(data)
            acc += torch.stack([(e.detach() - data.energy).abs().sum(), (f.detach() - data.force).abs().sum(),
                                torch.tensor(float(data.num_graphs), device=device),
                                torch.tensor(float(data.force.numel()), device=device)]).double()
        dist.all_reduce(acc)
        return (acc[0] / acc[2]).item(), (acc[1] / acc[3]).item()

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
    best = float("inf")
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in train_loader:
            data = data.to(device)
            e, f = model(data)
            loss = (e - data.energy).pow(2).mean() + cfg.force_weight * (f - data.force).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        e_mae, f_mae = run_eval(val_loader)
        sched.step(f_mae)
        if rank == 0:
            print(f"{epoch:4d} val E {e_mae * KCAL_TO_MEV:.2f} meV  F {f_mae * KCAL_TO_MEV:.2f} meV/A "
                  f"({time.time() - t0:.1f}s)", flush=True)
            if f_mae < best:
                best = f_mae
                torch.save(model.module.state_dict(), os.path.join(cfg.out, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(cfg.out, "best.pt"), map_location=device))
    e_mae, f_mae = run_eval(test_loader)
    if rank == 0:
        print(f"test E MAE {e_mae * KCAL_TO_MEV:.2f} meV  F MAE {f_mae * KCAL_TO_MEV:.2f} meV/A")
    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = parse()
    mp.spawn(train_worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)
