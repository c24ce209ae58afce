"""PhysNet-flavoured QM9 model: atomisation energy plus (optionally) the dipole
moment from predicted, charge-neutral atomic partial charges.

    torchrun --nproc_per_node=4 11_physnet_qm9_charges.py --energy-weight 1.0 --dipole-weight 0.0
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter

U0, MU = 7, 0
EA_TO_DEBYE = 4.80320


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/QM9")
    p.add_argument("--out", default="runs/physnet_qm9")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--modules", type=int, default=5)
    p.add_argument("--n-rbf", type=int, default=64)
    p.add_argument("--cutoff", type=float, default=10.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--energy-weight", type=float, default=1.0)
    p.add_argument("--dipole-weight", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args()


class ExpRBF(nn.Module):
    def __init__(self, n, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("centers", torch.linspace(1.0, math.exp(-cutoff), n))
        self.register_buffer("widths", torch.full((n,), (2.0 / n * (1 - math.exp(-cutoff))) ** -2))

    def forward(self, d):
        x = d / self.cutoff
        phi = torch.where(x < 1, 1 - 6 * x ** 5 + 15 * x ** 4 - 10 * x ** 3, torch.zeros_like(x))
        return phi.unsqueeze(-1) * torch.exp(-self.widths * (torch.exp(-d).unsqueeze(-1) - self.centers) ** 2)


class Residual(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.net = nn.Sequential(nn.SiLU(), nn.Linear(f, f), nn.SiLU(), nn.Linear(f, f))

    def forward(self, x):
        return x + self.net(x)


class InteractionModule(nn.Module):
    def __init__(self, f, n_rbf):
        super().__init__()
        self.g = nn.Linear(n_rbf, f, bias=False)
        self.lin_i = nn.Sequential(nn.SiLU(), nn.Linear(f, f))
        self.lin_j = nn.Sequential(nn.SiLU(), nn.Linear(f, f))
        self.res_int = Residual(f)
        self.gate = nn.Parameter(torch.ones(f))
        self.res_atom = Residual(f)

    def forward(self, x, edge_index, rbf):
        j, i = edge_index
        m = scatter(self.g(rbf) * self.lin_j(x)[j], i, dim=0, dim_size=x.size(0))
        v = self.res_int(self.lin_i(x) + m)
        return self.res_atom(self.gate * x + v)


class PhysNetLite(nn.Module):
    def __init__(self, f, modules, n_rbf, cutoff, atomref):
        super().__init__()
        self.cutoff = cutoff
        self.embedding = nn.Embedding(10, f)
        self.rbf = ExpRBF(n_rbf, cutoff)
        self.blocks = nn.ModuleList([InteractionModule(f, n_rbf) for _ in range(modules)])
        self.energy_head = nn.Sequential(Residual(f), nn.SiLU(), nn.Linear(f, 1))
        self.charge_head = nn.Sequential(Residual(f), nn.SiLU(), nn.Linear(f, 1))
        self.register_buffer("atomref", atomref.view(-1))

    def forward(self, z, pos, batch, num_graphs, with_dipole=False):
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=32)
        j, i = edge_index
        rbf = self.rbf((pos[j] - pos[i]).norm(dim=-1))
        x = self.embedding(z)
        for blk in self.blocks:
            x = blk(x, edge_index, rbf)
        e_atom = self.energy_head(x).squeeze(-1) + self.atomref[z]
        energy = scatter(e_atom, batch, dim=0, dim_size=num_graphs)
        if not with_dipole:
            return energy, None
        q = self.charge_head(x).squeeze(-1)
        q = q - scatter(q, batch, dim=0, dim_size=num_graphs, reduce="mean")[batch]  # neutral molecules
        center = scatter(pos, batch, dim=0, dim_size=num_graphs, reduce="mean")
        mu = scatter(q.unsqueeze(-1) * (pos - center[batch]), batch, dim=0, dim_size=num_graphs)
        return energy, mu.norm(dim=-1) * EA_TO_DEBYE


@torch.no_grad()
def evaluate(net, loader, device, with_dipole):
    net.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for b in loader:
        b = b.to(device)
        e, mu = net(b.z, b.pos, b.batch, b.num_graphs, with_dipole=with_dipole)
        acc[0] += (e - b.y[:, U0]).abs().sum()
        if mu is not None:
            acc[1] += (mu - b.y[:, MU]).abs().sum()
        acc[2] += b.num_graphs
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        QM9(args.root)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    dataset = QM9(args.root)
    atomref = dataset.atomref(U0)
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    train_set = dataset[perm[:110000]]
    val_set = dataset[perm[110000:120000]]
    test_set = dataset[perm[120000:]]

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True)
    val_loader = DataLoader(val_set[torch.arange(rank, len(val_set), world)], batch_size=128)
    test_loader = DataLoader(test_set[torch.arange(rank, len(test_set), world)], batch_size=128)

    model = PhysNetLite(args.features, args.modules, args.n_rbf, args.cutoff, atomref).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.1 ** (1 / 1000))
    use_dipole = args.dipole_weight > 0

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for b in train_loader:
            b = b.to(device, non_blocking=True)
            e, mu = model(b.z, b.pos, b.batch, b.num_graphs, with_dipole=use_dipole)
            loss = args.energy_weight * (e - b.y[:, U0]).abs().mean()
            if use_dipole:
                loss = loss + args.dipole_weight * (mu - b.y[:, MU]).abs().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            opt.step()
        sched.step()

        e_mae, mu_mae = evaluate(model.module, val_loader, device, use_dipole)
        if rank == 0:
            print(f"epoch {epoch:3d}  U0 MAE {e_mae * 1000:.1f} meV  mu MAE {mu_mae:.4f} D", flush=True)
            if e_mae < best:
                best = e_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    e_mae, mu_mae = evaluate(model.module, test_loader, device, use_dipole)
    if rank == 0:
        print(f"test U0 MAE {e_mae * 1000:.1f} meV  mu MAE {mu_mae:.4f} D (best epoch {ckpt['epoch']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
