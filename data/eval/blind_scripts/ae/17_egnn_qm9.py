"""EGNN on QM9: internal energy U0 with an auxiliary dipole-moment objective
(the dipole is built from predicted partial charges, mu = |sum_i q_i (r_i - r_c)|).

The dipole term is switched on after a warm-up phase on energies only.

    torchrun --nproc_per_node=4 17_egnn_qm9.py --root data/QM9 --dipole-after 50
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

HARTREE_TO_MEV = 27211.386
TARGET_MU, TARGET_U0 = 0, 7


class EGNNLayer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * h + 1, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))
        self.coord_mlp = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))
        nn.init.xavier_uniform_(self.coord_mlp[-1].weight, gain=0.001)

    def forward(self, h, x, edge_index):
        src, dst = edge_index
        rel = x[dst] - x[src]
        d2 = (rel ** 2).sum(-1, keepdim=True)
        m = self.edge_mlp(torch.cat([h[dst], h[src], d2], dim=-1))
        x = x + scatter(rel * self.coord_mlp(m), dst, dim=0, dim_size=x.size(0), reduce="mean")
        h = h + self.node_mlp(torch.cat([h, scatter(m, dst, dim=0, dim_size=h.size(0))], dim=-1))
        return h, x


class EGNN(nn.Module):
    def __init__(self, hidden=128, layers=7, n_node_feats=11):
        super().__init__()
        self.embed = nn.Linear(n_node_feats, hidden)
        self.layers = nn.ModuleList(EGNNLayer(hidden) for _ in range(layers))
        self.energy_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.charge_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, data, with_dipole=False):
        edge_index = data.full_edge_index
        h = self.embed(data.x)
        x = data.pos
        for layer in self.layers:
            h, x = layer(h, x, edge_index)
        energy = scatter(self.energy_head(h).squeeze(-1), data.batch, dim=0, reduce="sum")
        if not with_dipole:
            return energy, None
        q = self.charge_head(h).squeeze(-1)
        # neutral molecules: remove the mean charge per molecule
        q = q - scatter(q, data.batch, dim=0, reduce="mean")[data.batch]
        center = scatter(data.pos, data.batch, dim=0, reduce="mean")[data.batch]
        mu = scatter(q.unsqueeze(-1) * (data.pos - center), data.batch, dim=0, reduce="sum")
        return energy, mu.norm(dim=-1)


class FullyConnected:
    """Adds every ordered atom pair as an edge (QM9 molecules have <= 29 atoms)."""

    def __call__(self, data):
        n = data.num_nodes
        idx = torch.arange(n)
        row, col = idx.repeat_interleave(n), idx.repeat(n)
        mask = row != col
        data.full_edge_index = torch.stack([row[mask], col[mask]])
        return data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/QM9")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--dipole-after", type=int, default=50)
    ap.add_argument("--dipole-weight", type=float, default=0.1)
    ap.add_argument("--out", default="runs/egnn_qm9")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        QM9(args.root)
    dist.barrier()
    dataset = QM9(args.root, transform=FullyConnected())
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
    train_ds, val_ds = dataset[perm[:110000]], dataset[perm[110000:120000]]

    y_tr = dataset.y[perm[:110000], TARGET_U0]
    n_atoms = dataset.slices["x"][1:] - dataset.slices["x"][:-1]
    per_atom = (y_tr / n_atoms[perm[:110000]]).mean().item()   # eV per atom shift
    e_scale = y_tr.std().item()

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    model = EGNN(args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-16)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_dipole = epoch >= args.dipole_after
        t0 = time.time()
        for data in loader:
            data = data.to(device, non_blocking=True)
            e_ref = data.y[:, TARGET_U0] - per_atom * torch.bincount(data.batch).float()
            energy, mu = model(data, with_dipole=use_dipole)
            loss = F.l1_loss(energy, e_ref / e_scale)
            if use_dipole:
                loss = loss + args.dipole_weight * F.l1_loss(mu, data.y[:, TARGET_MU])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
        sched.step()

        model.eval()
        err = torch.zeros(3, device=device)
        with torch.no_grad():
            for data in val_loader:
                data = data.to(device)
                energy, mu = model(data, with_dipole=True)
                e = energy * e_scale + per_atom * torch.bincount(data.batch).float()
                err[0] += (e - data.y[:, TARGET_U0]).abs().sum()
                err[1] += (mu - data.y[:, TARGET_MU]).abs().sum()
                err[2] += data.num_graphs
        dist.all_reduce(err)
        u0_mae = (err[0] / err[2]).item() * 1000.0   # eV -> meV
        mu_mae = (err[1] / err[2]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} U0 MAE {u0_mae:.1f} meV  mu MAE {mu_mae:.3f} D  "
                  f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
            if u0_mae < best:
                best = u0_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "per_atom": per_atom, "e_scale": e_scale},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
