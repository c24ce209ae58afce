"""Behler-Parrinello network with on-the-fly radial + angular symmetry functions.

Per-element atomic MLPs, energies summed per molecule, forces from autograd.
Data: MD17 (PyG), e.g. uracil.

    torchrun --standalone --nproc_per_node=4 17_bpnn_md17_acsf.py --molecule uracil --epochs 2000
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import MD17
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter

ELEMENTS = (1, 6, 7, 8)


def cutoff_fn(r, rc):
    return 0.5 * (torch.cos(math.pi * r / rc) + 1.0) * (r < rc)


class ACSF(nn.Module):
    """G2 radial and G4 angular functions, element-resolved for the neighbours (radial only)."""

    def __init__(self, rc=5.0, n_radial=16, zetas=(1.0, 4.0, 16.0), eta_ang=0.5):
        super().__init__()
        self.rc = rc
        self.register_buffer("shifts", torch.linspace(0.8, rc - 0.5, n_radial))
        self.eta = 1.0 / (2 * ((rc - 1.3) / n_radial) ** 2)
        self.register_buffer("zetas", torch.tensor(zetas))
        self.eta_ang = eta_ang
        self.n_out = n_radial * len(ELEMENTS) + 2 * len(zetas)

    def forward(self, species, pos, batch):
        ij = radius_graph(pos, r=self.rc, batch=batch, max_num_neighbors=64)
        j, i = ij
        rij = pos[j] - pos[i]
        d = rij.norm(dim=-1)
        fc = cutoff_fn(d, self.rc)
        g2 = torch.exp(-self.eta * (d.unsqueeze(-1) - self.shifts) ** 2) * fc.unsqueeze(-1)
        onehot = nn.functional.one_hot(species[j], len(ELEMENTS)).to(g2.dtype)
        g2 = (g2.unsqueeze(1) * onehot.unsqueeze(-1)).flatten(1)
        radial = scatter(g2, i, dim=0, dim_size=pos.size(0))

        # triplets (j, i, k) centred on i: all pairs of edges sharing the centre atom
        same_centre = i.unsqueeze(0) == i.unsqueeze(1)
        same_centre.fill_diagonal_(False)
        e1, e2 = same_centre.nonzero(as_tuple=True)
        cos = (rij[e1] * rij[e2]).sum(-1) / (d[e1] * d[e2])
        w = torch.exp(-self.eta_ang * (d[e1] ** 2 + d[e2] ** 2)) * fc[e1] * fc[e2]
        ang = []
        for lam in (1.0, -1.0):
            base = (1 + lam * cos).clamp(min=0).unsqueeze(-1)
            ang.append(2 ** (1 - self.zetas) * base ** self.zetas * w.unsqueeze(-1))
        angular = scatter(torch.cat(ang, dim=-1), i[e1], dim=0, dim_size=pos.size(0))
        return torch.cat([radial, angular], dim=-1)


class BPNN(nn.Module):
    def __init__(self, hidden=(128, 128), rc=5.0, e_mean=0.0, f_std=1.0):
        super().__init__()
        self.acsf = ACSF(rc)
        n_in = self.acsf.n_out
        self.register_buffer("feat_mean", torch.zeros(n_in))
        self.register_buffer("feat_std", torch.ones(n_in))
        self.nets = nn.ModuleList()
        for _ in ELEMENTS:
            layers, d = [], n_in
            for h in hidden:
                layers += [nn.Linear(d, h), nn.Softplus()]
                d = h
            layers.append(nn.Linear(d, 1))
            self.nets.append(nn.Sequential(*layers))
        self.register_buffer("e_mean", torch.tensor(e_mean))
        self.register_buffer("f_std", torch.tensor(f_std))

    def forward(self, species, pos, batch, n_graphs):
        pos.requires_grad_(True)
        g = (self.acsf(species, pos, batch) - self.feat_mean) / self.feat_std
        e_atom = torch.zeros(pos.size(0), device=pos.device, dtype=pos.dtype)
        for s, net in enumerate(self.nets):
            mask = species == s
            e_atom = e_atom.masked_scatter(mask, net(g[mask]).squeeze(-1))
        energy = scatter(e_atom * self.f_std, batch, dim=0, dim_size=n_graphs) + self.e_mean
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def add_species(data):
    data.species = torch.tensor([ELEMENTS.index(int(z)) for z in data.z])
    return data


def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    for b in loader:
        b = b.to(device)
        e, f = net(b.species, b.pos, b.batch, b.num_graphs)
        acc[0] += (e.detach() - b.energy).abs().sum()
        acc[1] += (f.detach() - b.force).abs().sum()
        acc[2] += b.num_graphs
        acc[3] += b.force.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/MD17")
    ap.add_argument("--molecule", default="uracil")
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--force-weight", type=float, default=10.0)
    ap.add_argument("--out", default="runs/bpnn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    if rank == 0:
        MD17(args.root, name=args.molecule)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    ds = MD17(args.root, name=args.molecule, transform=add_species)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
    train_set = ds[perm[:args.n_train]]
    val_set = ds[perm[args.n_train:args.n_train + args.n_val]]
    test_set = ds[perm[args.n_train + args.n_val:]]

    e_tr = torch.cat([d.energy for d in train_set])
    f_tr = torch.cat([d.force for d in train_set])
    model = BPNN(rc=5.0, e_mean=e_tr.mean().item(), f_std=f_tr.std().item()).to(device)

    # feature normalisation from a few training batches (same frames on every rank)
    with torch.no_grad():
        feats = []
        for b in DataLoader(train_set[:200], batch_size=50):
            b = b.to(device)
            feats.append(model.acsf(b.species, b.pos, b.batch))
        feats = torch.cat(feats)
        model.feat_mean.copy_(feats.mean(0))
        model.feat_std.copy_(feats.std(0).clamp(min=1e-3))

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=2,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set[torch.arange(rank, len(val_set), world)], batch_size=64)
    test_loader = DataLoader(test_set[torch.arange(rank, len(test_set), world)], batch_size=64)

    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.7, patience=40, min_lr=1e-5)

    best = float("inf")
    for epoch in range(args.epochs):
        model.train()
        for b in train_loader:
            b = b.to(device, non_blocking=True)
            e, f = model(b.species, b.pos, b.batch, b.num_graphs)
            loss = ((e - b.energy) ** 2).mean() + args.force_weight * ((f - b.force) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        e_mae, f_mae = evaluate(model.module, val_loader, device)
        sched.step(f_mae)
        if rank == 0:
            if epoch % 10 == 0:
                print(f"epoch {epoch}: val E {e_mae:.3f} F {f_mae:.3f} kcal/mol(/A) "
                      f"lr {opt.param_groups[0]['lr']:.1e}", flush=True)
            if f_mae < best:
                best = f_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device)["model"])
    e_mae, f_mae = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"test: energy MAE {e_mae:.3f} kcal/mol, force MAE {f_mae:.3f} kcal/mol/A")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
