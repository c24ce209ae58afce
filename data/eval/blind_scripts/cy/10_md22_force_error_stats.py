"""Energy/force model trained jointly on several MD22 systems.

Besides the usual MAEs the evaluation reports the distribution of per-atom
force errors (median / 95th / 99th percentile / max), which is what matters
for stable MD.

    torchrun --standalone --nproc_per_node=4 10_md22_force_error_stats.py \
        --systems Ac-Ala3-NHMe DHA stachyose AT-AT --data-dir data/md22
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter_add

ELEMENTS = [1, 6, 7, 8]


def load_system(path, n_train, n_val, seed):
    raw = np.load(path)
    z = torch.as_tensor(raw["z"], dtype=torch.long)
    species = torch.as_tensor([ELEMENTS.index(int(a)) for a in raw["z"]])
    frames = [Data(z=z, species=species, pos=torch.as_tensor(R, dtype=torch.float32),
                   energy=torch.tensor([float(E)], dtype=torch.float64), force=torch.as_tensor(F, dtype=torch.float32))
              for R, E, F in zip(raw["R"], raw["E"].reshape(-1), raw["F"])]
    perm = np.random.default_rng(seed).permutation(len(frames))
    pick = lambda ids: [frames[i] for i in ids]
    return pick(perm[:n_train]), pick(perm[n_train:n_train + n_val]), pick(perm[n_train + n_val:])


def element_references(frames, ridge=1e-6):
    X = np.stack([np.bincount(f.species.numpy(), minlength=len(ELEMENTS)) for f in frames]).astype(np.float64)
    y = np.array([f.energy.item() for f in frames])
    return torch.tensor(np.linalg.solve(X.T @ X + ridge * np.eye(X.shape[1]), X.T @ y), dtype=torch.float64)


class RBF(nn.Module):
    def __init__(self, n, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("mu", torch.linspace(math.exp(-cutoff), 1.0, n))
        self.beta = (2.0 / n * (1 - math.exp(-cutoff))) ** -2

    def forward(self, d):
        fc = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        return fc.unsqueeze(-1) * torch.exp(-self.beta * (torch.exp(-d).unsqueeze(-1) - self.mu) ** 2)


class MessageBlock(nn.Module):
    def __init__(self, dim, n_rbf):
        super().__init__()
        self.W = nn.Linear(n_rbf, dim, bias=False)
        self.src = nn.Linear(dim, dim)
        self.upd = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, x, edge_index, rbf):
        j, i = edge_index
        m = scatter_add(self.src(x)[j] * self.W(rbf), i, dim=0, dim_size=x.size(0))
        return x + self.upd(m)


class Potential(nn.Module):
    def __init__(self, e_ref, dim=128, n_rbf=64, layers=5, cutoff=5.0):
        super().__init__()
        self.cutoff = cutoff
        self.emb = nn.Embedding(len(ELEMENTS), dim)
        self.rbf = RBF(n_rbf, cutoff)
        self.blocks = nn.ModuleList([MessageBlock(dim, n_rbf) for _ in range(layers)])
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))
        self.register_buffer("e_ref", e_ref)

    def forward(self, species, pos, batch, num_graphs):
        pos.requires_grad_(True)
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=128)
        j, i = edge_index
        d = (pos[j] - pos[i]).norm(dim=-1)
        x = self.emb(species)
        rbf = self.rbf(d)
        for blk in self.blocks:
            x = blk(x, edge_index, rbf)
        e_atom = self.head(x).squeeze(-1) + self.e_ref[species]
        energy = scatter_add(e_atom, batch, dim=0, dim_size=num_graphs)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def evaluate(net, loader, device, world):
    net.eval()
    e_abs = torch.zeros(2, dtype=torch.float64, device=device)
    f_err = []
    for data in loader:
        data = data.to(device)
        e, f = net(data.species, data.pos, data.batch, data.num_graphs)
        e_abs[0] += ((e.detach() - data.energy) / data.ptr.diff()).abs().sum()
        e_abs[1] += data.num_graphs
        f_err.append((f.detach() - data.force).norm(dim=-1))
    dist.all_reduce(e_abs)
    local = torch.cat(f_err)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    f_all = torch.cat(gathered)
    q = torch.quantile(f_all.float(), torch.tensor([0.5, 0.95, 0.99], device=device))
    return {"e_mae_per_atom": (e_abs[0] / e_abs[1]).item(), "f_mean": f_all.mean().item(),
            "f_p50": q[0].item(), "f_p95": q[1].item(), "f_p99": q[2].item(), "f_max": f_all.max().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", nargs="+", required=True)
    ap.add_argument("--data-dir", default="data/md22")
    ap.add_argument("--n-train", type=int, default=5000)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--force-weight", type=float, default=100.0)
    ap.add_argument("--out", default="runs/md22_joint")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train, val, test = [], [], []
    for k, name in enumerate(args.systems):
        tr, va, te = load_system(os.path.join(args.data_dir, f"md22_{name}.npz"), args.n_train, args.n_val, seed=k)
        train += tr
        val += va
        test += te
    e_ref = element_references(train)

    sampler = DistributedSampler(train, shuffle=True, seed=17)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=4)
    val_loader = DataLoader(val[rank::world], batch_size=8)
    test_loader = DataLoader(test[rank::world], batch_size=8)

    model = DDP(Potential(e_ref).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            e, f = model(data.species, data.pos, data.batch, data.num_graphs)
            n = data.ptr.diff()
            loss = (((e - data.energy) / n) ** 2).mean() + args.force_weight * ((f - data.force) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
        sched.step()

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            stats = evaluate(model.module, val_loader, device, world)
            if rank == 0:
                print(f"epoch {epoch + 1}", " ".join(f"{k} {v:.4f}" for k, v in stats.items()), flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "e_ref": e_ref},
                           os.path.join(args.out, "model.pt"))
            dist.barrier()

    stats = evaluate(model.module, test_loader, device, world)
    if rank == 0:
        print("TEST", " ".join(f"{k} {v:.4f}" for k, v in stats.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
