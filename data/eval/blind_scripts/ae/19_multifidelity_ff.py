"""Message-passing force field on a mixed dataset (energies + forces for all
structures, dipoles only for the subset computed at the higher level of theory).

Batches are built by an atom budget, so the number of molecules per batch varies.

    python 19_multifidelity_ff.py --data data/spice_subset.pt --gpus 4
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import Batch
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter


class AtomBudgetBatches:
    """Same batch list on every rank (seeded by epoch), then an equal share per rank."""

    def __init__(self, sizes, max_atoms, rank, world, seed=0):
        self.sizes, self.max_atoms = sizes, max_atoms
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def batches(self):
        order = list(range(len(self.sizes)))
        random.Random(self.seed + self.epoch).shuffle(order)
        out, cur, n = [], [], 0
        for i in order:
            if cur and n + self.sizes[i] > self.max_atoms:
                out.append(cur)
                cur, n = [], 0
            cur.append(i)
            n += self.sizes[i]
        if cur:
            out.append(cur)
        usable = len(out) // self.world * self.world
        return out[:usable][self.rank::self.world]


class Interaction(nn.Module):
    def __init__(self, h, n_rbf, cutoff):
        super().__init__()
        self.filter = nn.Sequential(nn.Linear(n_rbf, h), nn.SiLU(), nn.Linear(h, h))
        self.lin_in, self.lin_out = nn.Linear(h, h, bias=False), nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
        self.cutoff = cutoff

    def forward(self, h, edge_index, rbf, d):
        src, dst = edge_index
        fc = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        msg = self.lin_in(h)[src] * self.filter(rbf) * fc.unsqueeze(-1)
        return h + self.lin_out(scatter(msg, dst, dim=0, dim_size=h.size(0)))


class ForceField(nn.Module):
    def __init__(self, h=128, n_inter=4, n_rbf=32, cutoff=5.0, max_z=54):
        super().__init__()
        self.emb = nn.Embedding(max_z + 1, h)
        self.register_buffer("centers", torch.linspace(0, cutoff, n_rbf))
        self.inter = nn.ModuleList(Interaction(h, n_rbf, cutoff) for _ in range(n_inter))
        self.energy_head = nn.Sequential(nn.Linear(h, h // 2), nn.SiLU(), nn.Linear(h // 2, 1))
        self.charge_head = nn.Sequential(nn.Linear(h, h // 2), nn.SiLU(), nn.Linear(h // 2, 1))
        self.cutoff = cutoff

    def forward(self, z, pos, batch, want_dipole):
        edge_index = radius_graph(pos, self.cutoff, batch, max_num_neighbors=48)
        d = (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)
        rbf = torch.exp(-10.0 * (d.unsqueeze(-1) - self.centers) ** 2)
        h = self.emb(z)
        for block in self.inter:
            h = block(h, edge_index, rbf, d)
        energy = scatter(self.energy_head(h).squeeze(-1), batch, dim=0, reduce="sum")
        if not want_dipole:
            return energy, None
        q = self.charge_head(h).squeeze(-1)
        q = q - scatter(q, batch, dim=0, reduce="mean")[batch]
        return energy, scatter(q.unsqueeze(-1) * pos, batch, dim=0, reduce="sum")


def predict(model, b, want_dipole, train):
    pos = b.pos.requires_grad_(True)
    energy, dipole = model(b.z, pos, b.batch, want_dipole)
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=train)[0]
    return energy, forces, dipole


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    blob = torch.load(args.data)  # list of Data, plus energy reference, written by prepare_spice.py
    graphs, e_ref = blob["graphs"], blob["e_ref"]
    n_val = int(0.05 * len(graphs))
    val, train = graphs[:n_val], graphs[n_val:]
    sched_batches = AtomBudgetBatches([g.num_nodes for g in train], args.max_atoms, rank, world_size)
    my_val = val[rank::world_size]

    model = ForceField().to(device)
    # the charge head only runs for batches that carry dipole labels
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sched_batches.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for idx in sched_batches.batches():
            b = Batch.from_data_list([train[i] for i in idx]).to(device)
            has_dip = b.dipole_mask.bool()
            energy, forces, dipole = predict(model, b, bool(has_dip.any()), train=True)
            e_target = b.energy - scatter(e_ref.to(device)[b.z], b.batch, dim=0, reduce="sum")
            loss = F.mse_loss(energy / b.natoms, e_target / b.natoms) + args.w_f * F.mse_loss(forces, b.forces)
            if dipole is not None:
                loss = loss + args.w_mu * F.mse_loss(dipole[has_dip], b.dipole[has_dip])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])

        err = torch.zeros(3, device=device)
        model.eval()
        for i in range(0, len(my_val), 32):
            b = Batch.from_data_list(my_val[i:i + 32]).to(device)
            energy, forces, _ = predict(model.module, b, False, train=False)
            e_target = b.energy - scatter(e_ref.to(device)[b.z], b.batch, dim=0, reduce="sum")
            err[0] += (energy.detach() - e_target).abs().sum()
            err[1] += (forces.detach() - b.forces).abs().sum() / 3
            err[2] += b.num_graphs
        n_atoms_val = torch.tensor(float(sum(g.num_nodes for g in my_val)), device=device)
        dist.all_reduce(tl)
        dist.all_reduce(err)
        dist.all_reduce(n_atoms_val)
        if rank == 0:
            print(f"epoch {epoch} loss {(tl[0] / tl[1]).item():.4f} "
                  f"E-MAE {(err[0] / err[2]).item():.4f} F-MAE {(err[1] / n_atoms_val).item():.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--max-atoms", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--w-f", type=float, default=10.0)
    ap.add_argument("--w-mu", type=float, default=1.0)
    ap.add_argument("--out", default="runs/ff_multifidelity")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
