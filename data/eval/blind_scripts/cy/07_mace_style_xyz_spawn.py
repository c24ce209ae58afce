"""MACE-style invariant ACE potential trained on extended-XYZ data (3BPA / rMD17).

Single node, one process per GPU started with torch.multiprocessing.spawn.
Energies/forces are read with ASE; isolated-atom energies (E0s) are fitted by
least squares on the training compositions.

    python 07_mace_style_xyz_spawn.py --train data/3bpa/train_300K.xyz \
        --valid data/3bpa/test_300K.xyz --test data/3bpa/test_1200K.xyz --ngpus 4
"""
import argparse
import copy
import math
import os
import socket

import ase.io
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from e3nn import o3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter

Z_TABLE = [1, 6, 7, 8]


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--test", default=None)
    p.add_argument("--ngpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--lmax", type=int, default=3)
    p.add_argument("--interactions", type=int, default=2)
    p.add_argument("--r-max", type=float, default=5.0)
    p.add_argument("--num-bessel", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--energy-weight", type=float, default=1.0)
    p.add_argument("--forces-weight", type=float, default=100.0)
    p.add_argument("--max-epochs", type=int, default=800)
    p.add_argument("--out", default="runs/mace_style")
    p.add_argument("--restart", action="store_true")
    return p


def read_configs(path):
    configs = []
    for atoms in ase.io.read(path, index=":"):
        z = torch.tensor([Z_TABLE.index(int(n)) for n in atoms.numbers])
        configs.append(Data(species=z, pos=torch.tensor(atoms.positions),
                            energy=torch.tensor([atoms.get_potential_energy()], dtype=torch.float64),
                            forces=torch.tensor(atoms.get_forces()),
                            counts=torch.bincount(z, minlength=len(Z_TABLE)).double().unsqueeze(0)))
    return configs


def fit_e0s(configs):
    A = torch.cat([c.counts for c in configs]).numpy()
    b = torch.cat([c.energy for c in configs]).numpy()
    e0, *_ = np.linalg.lstsq(A, b, rcond=None)
    return torch.from_numpy(e0)


class Bessel(nn.Module):
    def __init__(self, r_max, n):
        super().__init__()
        self.r_max = r_max
        self.freq = nn.Parameter(torch.arange(1, n + 1) * math.pi / r_max)

    def forward(self, r):
        r = r.unsqueeze(-1)
        env = (1 - (r / self.r_max) ** 2).clamp(min=0) ** 2
        return math.sqrt(2.0 / self.r_max) * torch.sin(self.freq * r) / r * env


class ACELayer(nn.Module):
    """A-basis from radial x Y_lm x neighbour features, contracted to invariants."""

    def __init__(self, channels, lmax, num_bessel):
        super().__init__()
        self.lmax = lmax
        self.radial = nn.Sequential(nn.Linear(num_bessel, 64), nn.SiLU(), nn.Linear(64, (lmax + 1) * channels))
        self.lin_in = nn.Linear(channels, channels, bias=False)
        self.update = nn.Sequential(nn.Linear((lmax + 1) * channels + channels, channels), nn.SiLU(),
                                    nn.Linear(channels, channels))
        self.skip = nn.Linear(channels, channels, bias=False)

    def forward(self, h, edge_index, sh, rb):
        src, dst = edge_index
        n, c = h.shape
        R = self.radial(rb).view(-1, self.lmax + 1, c)
        l_index = torch.cat([torch.full((2 * l + 1,), l, device=h.device) for l in range(self.lmax + 1)])
        m = R[:, l_index, :] * sh.unsqueeze(-1) * self.lin_in(h)[src].unsqueeze(1)
        A = scatter(m, dst, dim=0, dim_size=n, reduce="sum")
        # power spectrum: sum_m A_lm^2 for every l -> rotation invariant (3-body)
        B = torch.stack([A[:, l * l:(l + 1) ** 2].pow(2).sum(1) for l in range(self.lmax + 1)], dim=1)
        return self.skip(h) + self.update(torch.cat([B.flatten(1), A[:, 0]], dim=-1))


class MACEStyle(nn.Module):
    def __init__(self, e0s, channels, lmax, interactions, r_max, num_bessel, avg_num_neighbors):
        super().__init__()
        self.r_max = r_max
        self.avg = avg_num_neighbors
        self.sh_irreps = o3.Irreps.spherical_harmonics(lmax)
        self.embed = nn.Linear(len(Z_TABLE), channels, bias=False)
        self.bessel = Bessel(r_max, num_bessel)
        self.layers = nn.ModuleList([ACELayer(channels, lmax, num_bessel) for _ in range(interactions)])
        self.readouts = nn.ModuleList([nn.Linear(channels, 1) for _ in range(interactions)])
        self.register_buffer("e0s", e0s)

    def forward(self, data, training=False):
        pos = data.pos.requires_grad_(True)
        edge_index = radius_graph(pos, self.r_max, data.batch, max_num_neighbors=100)
        src, dst = edge_index
        vec = pos[src] - pos[dst]
        r = vec.norm(dim=-1)
        sh = o3.spherical_harmonics(self.sh_irreps, vec, normalize=True, normalization="component")
        rb = self.bessel(r)
        onehot = nn.functional.one_hot(data.species, len(Z_TABLE)).to(pos.dtype)
        h = self.embed(onehot)
        e_atom = self.e0s[data.species]
        for layer, readout in zip(self.layers, self.readouts):
            h = layer(h, edge_index, sh, rb / self.avg)
            e_atom = e_atom + readout(h).squeeze(-1)
        energy = scatter(e_atom, data.batch, dim=0, dim_size=data.num_graphs, reduce="sum")
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=training)[0]
        return energy, forces


def metrics(model, loader, device):
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        e, f = model(data, training=False)
        de = (e.detach() - data.energy) / data.ptr.diff()
        sums[0] += de.pow(2).sum()
        sums[1] += (f.detach() - data.forces).pow(2).sum()
        sums[2] += data.num_graphs
        sums[3] += data.forces.numel()
        sums[4] += (f.detach() - data.forces).abs().sum()
    dist.all_reduce(sums)
    return {"rmse_e_per_atom": (sums[0] / sums[2]).sqrt().item(),
            "rmse_f": (sums[1] / sums[3]).sqrt().item(),
            "mae_f": (sums[4] / sums[3]).item()}


def worker(rank, world_size, args, train, valid, test, e0s):
    torch.set_default_dtype(torch.float64)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=1)
    valid_loader = DataLoader(valid[rank::world_size], batch_size=20)
    test_loader = DataLoader(test[rank::world_size], batch_size=20) if test else None

    model = MACEStyle(e0s, args.channels, args.lmax, args.interactions, args.r_max, args.num_bessel,
                      avg_num_neighbors=12.0).to(device)
    ema = copy.deepcopy(model)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=50)

    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    start = 0
    if args.restart and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
    else:
        ema.load_state_dict(model.module.state_dict())

    best = float("inf")
    for epoch in range(start, args.max_epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data in train_loader:
            data = data.to(device)
            e, f = model(data, training=True)
            n_atoms = data.ptr.diff()
            loss = (args.energy_weight * (((e - data.energy) / n_atoms) ** 2).mean()
                    + args.forces_weight * ((f - data.forces) ** 2).mean())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.module.parameters()):
                    pe.lerp_(p, 1.0 - args.ema_decay)

        m = metrics(ema, valid_loader, device)
        sched.step(m["rmse_f"])
        if rank == 0:
            print(f"epoch {epoch} RMSE E/atom {m['rmse_e_per_atom'] * 1e3:.2f} meV "
                  f"RMSE F {m['rmse_f'] * 1e3:.2f} meV/A lr {opt.param_groups[0]['lr']:.2e}", flush=True)
            state = {"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if m["rmse_f"] < best:
                best = m["rmse_f"]
                torch.save(ema.state_dict(), os.path.join(args.out, "best_ema.pt"))
        dist.barrier()

    if test_loader is not None:
        ema.load_state_dict(torch.load(os.path.join(args.out, "best_ema.pt"), map_location=device))
        m = metrics(ema, test_loader, device)
        if rank == 0:
            print("test:", {k: round(v * 1e3, 2) for k, v in m.items()}, "(meV, meV/A)")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main():
    args = get_parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    train = read_configs(args.train)
    valid = read_configs(args.valid)
    test = read_configs(args.test) if args.test else []
    e0s = fit_e0s(train)
    print("E0s:", dict(zip(Z_TABLE, e0s.tolist())))

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(worker, args=(args.ngpus, args, train, valid, test, e0s), nprocs=args.ngpus, join=True)


if __name__ == "__main__":
    main()
