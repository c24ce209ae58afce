"""Train a SchNet-style force field on SPICE (HDF5) with DDP.

Reports energy MAE and force-error percentiles (median / p95 / max), since the
tail of the force error distribution is what breaks MD stability.

    torchrun --standalone --nproc_per_node=8 03_spice_force_field.py --h5 /data/SPICE-1.1.4.hdf5
"""
import argparse
import math
import os
import random

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter

HARTREE_TO_EV = 27.211386246
BOHR_TO_ANG = 0.529177210903


class SpiceDataset(Dataset):
    """One item per conformation. Index is built once (cheap), arrays are read lazily."""

    def __init__(self, path, max_atoms=110):
        self.path = path
        self.h5 = None
        self.index = []
        with h5py.File(path, "r") as f:
            for name in sorted(f.keys()):
                g = f[name]
                if g["atomic_numbers"].shape[0] > max_atoms:
                    continue
                for c in range(g["conformations"].shape[0]):
                    self.index.append((name, c))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        name, c = self.index[i]
        g = self.h5[name]
        z = torch.from_numpy(g["atomic_numbers"][()].astype(np.int64))
        pos = torch.from_numpy(g["conformations"][c].astype(np.float32)) * BOHR_TO_ANG
        energy = float(g["formation_energy"][c]) * HARTREE_TO_EV
        forces = -torch.from_numpy(g["dft_total_gradient"][c].astype(np.float32)) * (HARTREE_TO_EV / BOHR_TO_ANG)
        return Data(z=z, pos=pos, y=torch.tensor([energy]), forces=forces, natoms=torch.tensor([z.numel()]))


class ShiftedSoftplus(nn.Module):
    def forward(self, x):
        return F.softplus(x) - math.log(2.0)


class Interaction(nn.Module):
    def __init__(self, hidden, num_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.filter = nn.Sequential(nn.Linear(num_rbf, hidden), ShiftedSoftplus(), nn.Linear(hidden, hidden))
        self.lin_in = nn.Linear(hidden, hidden, bias=False)
        self.lin_out = nn.Sequential(nn.Linear(hidden, hidden), ShiftedSoftplus(), nn.Linear(hidden, hidden))

    def forward(self, h, edge_index, d, rbf):
        src, dst = edge_index
        c = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        w = self.filter(rbf) * c.unsqueeze(-1)
        m = scatter(self.lin_in(h)[src] * w, dst, dim=0, dim_size=h.size(0))
        return h + self.lin_out(m)


class ForceField(nn.Module):
    def __init__(self, hidden=256, layers=6, num_rbf=64, cutoff=5.0):
        super().__init__()
        self.cutoff = cutoff
        self.embed = nn.Embedding(100, hidden)
        self.register_buffer("centers", torch.linspace(0.0, cutoff, num_rbf))
        self.gamma = 10.0 / cutoff
        self.blocks = nn.ModuleList([Interaction(hidden, num_rbf, cutoff) for _ in range(layers)])
        self.head = nn.Sequential(nn.Linear(hidden, hidden // 2), ShiftedSoftplus(), nn.Linear(hidden // 2, 1))

    def forward(self, z, pos, batch):
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        d = (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)
        rbf = torch.exp(-self.gamma * (d.unsqueeze(-1) - self.centers) ** 2)
        h = self.embed(z)
        for blk in self.blocks:
            h = blk(h, edge_index, d, rbf)
        return scatter(self.head(h).squeeze(-1), batch, dim=0, reduce="sum")


def predict(model, data, train):
    pos = data.pos.requires_grad_(True)
    e = model(data.z, pos, data.batch)
    f = -torch.autograd.grad(e.sum(), pos, create_graph=train)[0]
    return e, f


def evaluate(model, loader, device, world_size):
    model.eval()
    e_abs, n_mol = torch.zeros((), device=device), torch.zeros((), device=device)
    force_errs = []
    for data in loader:
        data = data.to(device)
        e, f = predict(model, data, train=False)
        e_abs += (e.detach() - data.y).abs().sum()
        n_mol += data.num_graphs
        force_errs.append((f.detach() - data.forces).norm(dim=-1))
    dist.all_reduce(e_abs)
    dist.all_reduce(n_mol)

    local_err = torch.cat(force_errs)
    gathered = [torch.empty_like(local_err) for _ in range(world_size)]
    dist.all_gather(gathered, local_err)
    all_err = torch.cat(gathered)
    q = torch.quantile(all_err.float().cpu(), torch.tensor([0.5, 0.95]))
    return {
        "energy_mae": (e_abs / n_mol).item(),
        "force_mae": all_err.mean().item(),
        "force_p50": q[0].item(),
        "force_p95": q[1].item(),
        "force_max": all_err.max().item(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True)
    ap.add_argument("--out", default="checkpoints/spice_ff")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--energy_weight", type=float, default=0.05)
    ap.add_argument("--val_fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = SpiceDataset(args.h5)
    # split by molecule name so conformers of one molecule never end up on both sides
    names = sorted({n for n, _ in dataset.index})
    rng = random.Random(args.seed)
    rng.shuffle(names)
    val_names = set(names[: int(len(names) * args.val_fraction)])
    train_idx = [i for i, (n, _) in enumerate(dataset.index) if n not in val_names]
    val_idx = [i for i, (n, _) in enumerate(dataset.index) if n in val_names]
    train_set = torch.utils.data.Subset(dataset, train_idx)
    val_set = torch.utils.data.Subset(dataset, val_idx)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler, num_workers=4)

    torch.manual_seed(args.seed)
    model = DDP(ForceField().to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader), eta_min=1e-6)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            e, f = predict(model, data, train=True)
            natoms = data.natoms.to(e.dtype)
            e_loss = F.mse_loss(e / natoms, data.y / natoms)
            f_loss = F.mse_loss(f, data.forces)
            loss = args.energy_weight * e_loss + f_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 50.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}:{it}] loss {loss.item():.4f} (E {e_loss.item():.4f}, F {f_loss.item():.4f})", flush=True)

        metrics = evaluate(model.module, val_loader, device, world_size)
        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "metrics": metrics}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if metrics["force_mae"] < best:
                best = metrics["force_mae"]
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
