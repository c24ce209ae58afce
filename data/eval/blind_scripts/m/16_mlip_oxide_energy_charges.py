"""
Machine-learned interatomic potential for amorphous Li-Si-O, energy-only training on DFT frames.
Hand-written equivariant-free message passing (distance features only), periodic cells.

frames.pkl: list of dict(numbers (n,), positions (n,3), cell (3,3), energy float [eV],
                         charges (n,) Bader charges or None)

The partial-charge head is meant for the long-range (Ewald) variant; we keep it in the model so
checkpoints stay compatible between the two codes.

    torchrun --nproc_per_node=4 16_mlip_oxide_energy_charges.py --frames data/lisio_frames.pkl
"""
import argparse
import os
import pickle
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SPECIES = {3: 0, 8: 1, 14: 2}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--frames", default="data/lisio_frames.pkl")
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--n_mp", type=int, default=3)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--charge_weight", type=float, default=0.0)
    p.add_argument("--out", default="mlip_runs/lisio_v3")
    return p.parse_args()


def neighbour_list(pos, cell, cutoff):
    """Brute force minimum-image neighbour list (cells here are > 2*cutoff)."""
    inv = np.linalg.inv(cell)
    frac = pos @ inv
    dfrac = frac[None, :, :] - frac[:, None, :]
    dfrac -= np.round(dfrac)
    dvec = dfrac @ cell
    dist_ = np.linalg.norm(dvec, axis=-1)
    i, j = np.nonzero((dist_ < cutoff) & (dist_ > 1e-8))
    return i, j, dist_[i, j]


class Frames(Dataset):
    def __init__(self, frames, cutoff):
        self.items = []
        for fr in frames:
            i, j, d = neighbour_list(fr["positions"], fr["cell"], cutoff)
            self.items.append((
                torch.tensor([SPECIES[z] for z in fr["numbers"]], dtype=torch.long),
                torch.from_numpy(np.stack([i, j])).long(),
                torch.from_numpy(d).float(),
                torch.tensor(fr["energy"], dtype=torch.float32),
            ))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        return self.items[k]


def collate(batch):
    species, edges, dists, energies, graph_id = [], [], [], [], []
    off = 0
    for g, (s, e, d, E) in enumerate(batch):
        species.append(s)
        edges.append(e + off)
        dists.append(d)
        energies.append(E)
        graph_id.append(torch.full((len(s),), g, dtype=torch.long))
        off += len(s)
    return torch.cat(species), torch.cat(edges, 1), torch.cat(dists), torch.stack(energies), torch.cat(graph_id)


class BesselRBF(nn.Module):
    def __init__(self, n, cutoff):
        super().__init__()
        self.register_buffer("freq", torch.arange(1, n + 1).float() * np.pi / cutoff)
        self.cutoff = cutoff

    def forward(self, d):
        env = 0.5 * (torch.cos(np.pi * d / self.cutoff) + 1.0)
        return (torch.sin(self.freq * d[:, None]) / d[:, None]) * env[:, None]


class MP(nn.Module):
    def __init__(self, h, n_rbf):
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(n_rbf, h), nn.SiLU(), nn.Linear(h, h))
        self.node = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))

    def forward(self, x, ei, rbf):
        m = x[ei[1]] * self.edge(rbf)
        agg = torch.zeros_like(x).index_add_(0, ei[0], m)
        return x + self.node(torch.cat([x, agg], -1))


class Potential(nn.Module):
    def __init__(self, hidden, n_mp, cutoff, n_rbf=16):
        super().__init__()
        self.embed = nn.Embedding(len(SPECIES), hidden)
        self.rbf = BesselRBF(n_rbf, cutoff)
        self.mp = nn.ModuleList([MP(hidden, n_rbf) for _ in range(n_mp)])
        self.energy_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.charge_head = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))
        self.atom_ref = nn.Parameter(torch.zeros(len(SPECIES)))

    def forward(self, species, ei, d, graph_id, n_graphs, with_charges=False):
        x = self.embed(species)
        rbf = self.rbf(d)
        for layer in self.mp:
            x = layer(x, ei, rbf)
        e_atom = self.energy_head(x).squeeze(-1) + self.atom_ref[species]
        energy = torch.zeros(n_graphs, device=x.device).index_add_(0, graph_id, e_atom)
        if with_charges:
            return energy, self.charge_head(x).squeeze(-1)
        return energy


def fit_atom_ref(frames):
    """Least-squares per-species reference energies, so the net learns the residual."""
    A = np.zeros((len(frames), len(SPECIES)))
    for k, fr in enumerate(frames):
        for z in fr["numbers"]:
            A[k, SPECIES[z]] += 1
    b = np.array([fr["energy"] for fr in frames])
    ref, *_ = np.linalg.lstsq(A, b, rcond=None)
    return torch.tensor(ref, dtype=torch.float32)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.frames, "rb") as f:
        frames = pickle.load(f)
    rng = np.random.default_rng(42)
    perm = rng.permutation(len(frames))
    n_val = max(50, len(frames) // 10)
    val_frames = [frames[i] for i in perm[:n_val]]
    train_frames = [frames[i] for i in perm[n_val:]]

    train_ds = Frames(train_frames, args.cutoff)
    val_ds = Frames(val_frames, args.cutoff)
    n_atoms_val = torch.tensor([len(fr["numbers"]) for fr in val_frames], dtype=torch.float32)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=2)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(Subset(val_ds, val_idx), batch_size=16, collate_fn=collate)

    net = Potential(args.hidden, args.n_mp, args.cutoff)
    with torch.no_grad():
        net.atom_ref.copy_(fit_atom_ref(train_frames))
    net = net.to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.995)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    rows = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for species, ei, d, E, gid in train_dl:
            species, ei, d, E, gid = species.to(device), ei.to(device), d.to(device), E.to(device), gid.to(device)
            n_at = torch.bincount(gid).float()
            if args.charge_weight > 0:
                pred_E, q = model(species, ei, d, gid, len(E), with_charges=True)
                loss = (((pred_E - E) / n_at) ** 2).mean() + args.charge_weight * (q.sum() ** 2)
            else:
                pred_E = model(species, ei, d, gid, len(E))
                loss = (((pred_E - E) / n_at) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(acc)

        net.eval()
        err = torch.zeros(2, device=device)
        with torch.no_grad():
            for k, (species, ei, d, E, gid) in enumerate(val_dl):
                pred_E = net(species.to(device), ei.to(device), d.to(device), gid.to(device), len(E))
                n_at = torch.bincount(gid.to(device)).float()
                err += torch.stack([((pred_E.cpu() - E).abs().to(device) / n_at).sum(),
                                    torch.tensor(float(len(E)), device=device)])
        dist.all_reduce(err)
        mae_mev = 1000 * (err[0] / err[1]).item()
        if rank == 0:
            rows.append({"epoch": epoch, "train_loss": (acc[0] / acc[1]).item(), "val_mae_meV_atom": mae_mev,
                         "lr": sched.get_last_lr()[0], "time": time.time() - t0})
            print(rows[-1], flush=True)
            pd.DataFrame(rows).to_csv(os.path.join(args.out, "train_log.csv"), index=False)
            torch.save({"model": net.state_dict(), "args": vars(args), "epoch": epoch},
                       os.path.join(args.out, "potential.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
