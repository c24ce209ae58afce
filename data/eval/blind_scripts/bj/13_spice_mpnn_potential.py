"""Equivariant-free message passing potential (SchNet-like continuous filters with
radial Bessel basis) trained on SPICE 2 conformations, energies + forces.
At the end of each validation pass the predictions are collected on rank 0 and
written to disk for parity plots.

    torchrun --nproc_per_node=8 13_spice_mpnn_potential.py --h5 /data/spice/SPICE-2.0.1_filtered.h5
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter

HARTREE_TO_EV = 27.211386
BOHR_TO_ANG = 0.529177


class SpiceConformers(Dataset):
    def __init__(self, path):
        self.path = path
        self.index = []
        with h5py.File(path, "r") as f:
            for name in f:
                n_conf = f[name]["conformations"].shape[0]
                self.index += [(name, i) for i in range(n_conf)]
        self._f = None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        if self._f is None:
            self._f = h5py.File(self.path, "r")
        name, i = self.index[k]
        g = self._f[name]
        z = torch.from_numpy(g["atomic_numbers"][()].astype(np.int64))
        pos = torch.from_numpy(g["conformations"][i].astype(np.float32)) * BOHR_TO_ANG
        e = float(g["formation_energy"][i]) * HARTREE_TO_EV
        f = -torch.from_numpy(g["dft_total_gradient"][i].astype(np.float32)) * HARTREE_TO_EV / BOHR_TO_ANG
        return z, pos, e, f


def collate(batch):
    z, pos, e, f = zip(*batch)
    n = torch.tensor([len(a) for a in z])
    return (torch.cat(z), torch.cat(pos), torch.tensor(e, dtype=torch.float64), torch.cat(f),
            torch.repeat_interleave(torch.arange(len(z)), n))


class BesselBasis(nn.Module):
    def __init__(self, n, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("freq", torch.arange(1, n + 1) * math.pi / cutoff)

    def forward(self, d):
        d = d.unsqueeze(-1)
        env = 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1.0)
        return env * torch.sin(self.freq * d) / d


class Interaction(nn.Module):
    def __init__(self, h, n_rbf):
        super().__init__()
        self.filt = nn.Sequential(nn.Linear(n_rbf, h), nn.SiLU(), nn.Linear(h, h))
        self.lin_in = nn.Linear(h, h, bias=False)
        self.out = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))

    def forward(self, x, rbf, src, dst):
        m = self.lin_in(x)[src] * self.filt(rbf)
        return x + self.out(scatter(m, dst, dim=0, dim_size=x.shape[0], reduce="sum"))


class Potential(nn.Module):
    def __init__(self, hidden=256, n_inter=5, n_rbf=20, cutoff=5.0, max_z=54):
        super().__init__()
        self.cutoff = cutoff
        self.embed = nn.Embedding(max_z + 1, hidden)
        self.rbf = BesselBasis(n_rbf, cutoff)
        self.layers = nn.ModuleList([Interaction(hidden, n_rbf) for _ in range(n_inter)])
        self.readout = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))
        self.atom_ref = nn.Embedding(max_z + 1, 1)
        nn.init.zeros_(self.atom_ref.weight)

    def forward(self, z, pos, batch):
        src, dst = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        d = (pos[src] - pos[dst]).norm(dim=-1)
        rbf = self.rbf(d)
        x = self.embed(z)
        for layer in self.layers:
            x = layer(x, rbf, src, dst)
        e_atom = self.readout(x) + self.atom_ref(z)
        return scatter(e_atom.squeeze(-1), batch, dim=0, reduce="sum")


def predict(model, z, pos, batch, train):
    pos.requires_grad_(True)
    energy = model(z, pos, batch)
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=train)[0]
    return energy, forces


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", default="/data/spice/SPICE-2.0.1_filtered.h5")
    ap.add_argument("--out", default="/data/runs/spice_mpnn")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--w-energy", type=float, default=1.0)
    ap.add_argument("--w-force", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    ds = SpiceConformers(args.h5)
    perm = np.random.default_rng(args.seed).permutation(len(ds))
    n_val = int(args.val_fraction * len(ds))
    val_set, train_set = Subset(ds, perm[:n_val].tolist()), Subset(ds, perm[n_val:].tolist())
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, n_val, world))), batch_size=64,
                            collate_fn=collate, num_workers=2)

    model = Potential().to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-6, amsgrad=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for it, (z, pos, e, f, batch) in enumerate(train_loader):
            z, pos, batch = z.to(device), pos.to(device), batch.to(device)
            e, f = e.to(device).float(), f.to(device)
            n_atoms = torch.bincount(batch).float()
            e_pred, f_pred = predict(ddp, z, pos, batch, train=True)
            loss_e = F.huber_loss(e_pred / n_atoms, e / n_atoms, delta=0.01)
            loss_f = F.huber_loss(f_pred, f, delta=0.01)
            loss = args.w_energy * loss_e + args.w_force * loss_f
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
            opt.step()
            if rank == 0 and it % 500 == 0:
                print(f"epoch {epoch} it {it} loss_e {loss_e.item():.5f} loss_f {loss_f.item():.5f}", flush=True)
        sched.step()

        model.eval()
        e_err, f_pred_all, f_ref_all = [], [], []
        for z, pos, e, f, batch in val_loader:
            z, pos, batch = z.to(device), pos.to(device), batch.to(device)
            e_pred, f_pred = predict(model, z, pos, batch, train=False)
            e_err.append((e_pred.detach().double() - e.to(device)).abs())
            f_pred_all.append(f_pred.detach())
            f_ref_all.append(f.to(device))
        e_err = torch.cat(e_err)
        f_pred_all, f_ref_all = torch.cat(f_pred_all), torch.cat(f_ref_all)

        gathered_pred = [torch.zeros_like(f_pred_all) for _ in range(world)]
        gathered_ref = [torch.zeros_like(f_ref_all) for _ in range(world)]
        dist.all_gather(gathered_pred, f_pred_all)
        dist.all_gather(gathered_ref, f_ref_all)
        e_stats = torch.stack([e_err.sum(), torch.tensor(float(e_err.numel()), device=device, dtype=torch.float64)])
        dist.all_reduce(e_stats)

        if rank == 0:
            fp, fr = torch.cat(gathered_pred).cpu().numpy(), torch.cat(gathered_ref).cpu().numpy()
            f_mae = np.abs(fp - fr).mean()
            e_mae = (e_stats[0] / e_stats[1]).item()
            print(f"epoch {epoch} val E-MAE {1000 * e_mae:.1f} meV  F-MAE {1000 * f_mae:.1f} meV/A  "
                  f"({time.time() - t0:.0f}s)", flush=True)
            np.savez_compressed(os.path.join(args.out, f"val_forces_{epoch:03d}.npz"), pred=fp, ref=fr)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
