#!/usr/bin/env python
"""Universal interatomic potential on an MPtrj-style ASE database (energy + forces).

Neighbour lists are built per structure in the DataLoader workers with ASE, so
the GPU only sees edge_index + periodic shift vectors.  Jobs are pre-empted often,
so the script always resumes from <run_dir>/last.pt if it exists.

    torchrun --nproc_per_node=8 10_mptrj_forcefield_resume.py \
        --db /shared/mptrj/mptrj.db --run_dir /shared/runs/uip_v3
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
from ase.db import connect
from ase.neighborlist import neighbor_list
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


class AseDbGraphs(Dataset):
    def __init__(self, db_path, cutoff):
        self.db_path, self.cutoff = db_path, cutoff
        with connect(db_path) as db:
            self.ids = [row.id for row in db.select(columns=["id"])]
        self._db = None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self._db is None:
            self._db = connect(self.db_path)
        row = self._db.get(id=self.ids[i])
        atoms = row.toatoms()
        src, dst, S = neighbor_list("ijS", atoms, self.cutoff)
        return Data(
            z=torch.as_tensor(atoms.numbers, dtype=torch.long),
            pos=torch.as_tensor(atoms.positions, dtype=torch.float32),
            cell=torch.as_tensor(np.asarray(atoms.cell), dtype=torch.float32).unsqueeze(0),
            edge_index=torch.as_tensor(np.stack([src, dst]), dtype=torch.long),
            shift=torch.as_tensor(S, dtype=torch.float32),
            energy=torch.tensor([row.energy], dtype=torch.float32),
            forces=torch.as_tensor(row.forces, dtype=torch.float32),
            natoms=torch.tensor([len(atoms)]),
        )


def polynomial_envelope(d, cutoff, p=6):
    x = d / cutoff
    return 1 - (p + 1) * (p + 2) / 2 * x ** p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)


class Block(nn.Module):
    def __init__(self, hidden, n_rbf):
        super().__init__()
        self.filt = nn.Linear(n_rbf, hidden)
        self.msg = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.upd = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h, edge_index, rbf):
        m = self.msg(h)[edge_index[0]] * self.filt(rbf)
        agg = scatter(m, edge_index[1], dim=0, dim_size=h.size(0))
        return h + self.upd(torch.cat([h, agg], dim=-1))


class Potential(nn.Module):
    def __init__(self, hidden=128, n_blocks=4, n_rbf=16, cutoff=5.0, n_elements=95):
        super().__init__()
        self.cutoff, self.n_rbf = cutoff, n_rbf
        self.emb = nn.Embedding(n_elements, hidden)
        self.blocks = nn.ModuleList(Block(hidden, n_rbf) for _ in range(n_blocks))
        self.out = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.elem_ref = nn.Embedding(n_elements, 1)  # per-element reference energies, learned
        nn.init.zeros_(self.elem_ref.weight)

    def forward(self, data):
        src, dst = data.edge_index
        graph_of_edge = data.batch[src]
        # ASE convention: D_ij = r_j - r_i + S_ij . cell
        vec = data.pos[dst] - data.pos[src] + torch.einsum("ek,ekl->el", data.shift, data.cell[graph_of_edge])
        d = vec.norm(dim=-1)
        n = torch.arange(1, self.n_rbf + 1, device=d.device, dtype=d.dtype)
        rbf = torch.sin(n * math.pi * d.unsqueeze(-1) / self.cutoff) / d.unsqueeze(-1)
        rbf = rbf * polynomial_envelope(d, self.cutoff).unsqueeze(-1)
        h = self.emb(data.z)
        for blk in self.blocks:
            h = blk(h, data.edge_index, rbf)
        e_atom = self.out(h).squeeze(-1) + self.elem_ref(data.z).squeeze(-1)
        return scatter(e_atom, data.batch, dim=0, dim_size=data.num_graphs)


def energy_forces(model, data, training):
    data.pos.requires_grad_(True)
    e = model(data)
    f = -torch.autograd.grad(e.sum(), data.pos, create_graph=training)[0]
    return e, f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--force_weight", type=float, default=1.0)
    ap.add_argument("--val_frac", type=float, default=0.02)
    ap.add_argument("--ckpt_every", type=int, default=2000, help="steps")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds = AseDbGraphs(args.db, args.cutoff)
    rng = np.random.default_rng(2024)
    order = rng.permutation(len(ds))
    n_val = int(args.val_frac * len(ds))
    train_set, val_set = Subset(ds, order[n_val:].tolist()), Subset(ds, order[:n_val].tolist()[rank::world])

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=10,
                              pin_memory=True, persistent_workers=True, prefetch_factor=4)
    val_loader = DataLoader(val_set, batch_size=48, num_workers=4)

    model = DDP(Potential(cutoff=args.cutoff).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 1000) * 0.5 * (1 + math.cos(math.pi * s / total)))

    last_path = os.path.join(args.run_dir, "last.pt")
    epoch0, step = 0, 0
    if os.path.isfile(last_path):
        ckpt = torch.load(last_path)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        epoch0, step = ckpt["epoch"], ckpt["step"]
        del ckpt

    writer = None
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.run_dir, "tb"), purge_step=step)

    def save(epoch):
        if rank == 0:
            tmp = last_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "step": step}, tmp)
            os.replace(tmp, last_path)

    steps_per_epoch = len(train_loader)
    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, data in enumerate(train_loader):
            if epoch == epoch0 and i < step - epoch * steps_per_epoch:
                continue  # fast-forward inside a partially finished epoch
            data = data.to(device, non_blocking=True)
            e, f = energy_forces(model, data, training=True)
            natoms = data.natoms.float()
            e_loss = F.huber_loss(e / natoms, data.energy / natoms, delta=0.01)
            f_loss = F.huber_loss(f, data.forces, delta=0.01)
            loss = e_loss + args.force_weight * f_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/e_loss", e_loss.item(), step)
                writer.add_scalar("train/f_loss", f_loss.item(), step)
                writer.add_scalar("lr", sched.get_last_lr()[0], step)
            if step % args.ckpt_every == 0:
                save(epoch)

        model.eval()
        acc = torch.zeros(4, device=device, dtype=torch.float64)
        for data in val_loader:
            data = data.to(device)
            e, f = energy_forces(model.module, data, training=False)
            acc[0] += ((e.detach() - data.energy) / data.natoms).abs().sum()
            acc[1] += data.num_graphs
            acc[2] += (f.detach() - data.forces).abs().sum()
            acc[3] += f.numel()
        dist.all_reduce(acc)
        if rank == 0:
            e_mae, f_mae = (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()
            writer.add_scalar("val/energy_mae_per_atom", e_mae, step)
            writer.add_scalar("val/force_mae", f_mae, step)
            print(f"epoch {epoch} done ({time.time() - t0:.0f}s): E {e_mae * 1000:.1f} meV/atom, F {f_mae * 1000:.1f} meV/A",
                  flush=True)
        save(epoch + 1)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
