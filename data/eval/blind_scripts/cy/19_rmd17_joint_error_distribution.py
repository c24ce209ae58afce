"""One potential for all ten rMD17 molecules, with a per-molecule error table and
the distribution of per-atom force errors on the test frames.

The ten npz files are merged once into a cached tensor file.

    torchrun --standalone --nproc_per_node=4 19_rmd17_joint_error_distribution.py --npz-dir data/rmd17/npz_data
"""
import argparse
import glob
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
from torch_scatter import scatter

Z_INDEX = {1: 0, 6: 1, 7: 2, 8: 3}
KCAL_MOL_TO_MEV = 43.364


def build_cache(npz_dir, cache_file, n_train=950, n_val=50, n_test=1000, seed=0):
    names, frames = [], []
    rng = np.random.default_rng(seed)
    for mol_id, path in enumerate(sorted(glob.glob(os.path.join(npz_dir, "rmd17_*.npz")))):
        names.append(os.path.basename(path)[6:-4])
        raw = np.load(path)
        order = rng.permutation(len(raw["energies"]))
        split = np.full(len(order), -1)
        split[order[:n_train]] = 0
        split[order[n_train:n_train + n_val]] = 1
        split[order[n_train + n_val:n_train + n_val + n_test]] = 2
        species = torch.tensor([Z_INDEX[int(z)] for z in raw["nuclear_charges"]])
        for k in np.nonzero(split >= 0)[0]:
            frames.append({"species": species, "pos": torch.tensor(raw["coords"][k], dtype=torch.float32),
                           "energy": float(raw["energies"][k]), "force": torch.tensor(raw["forces"][k], dtype=torch.float32),
                           "mol": mol_id, "split": int(split[k])})
    tmp = cache_file + ".tmp"
    torch.save({"names": names, "frames": frames}, tmp)
    os.replace(tmp, cache_file)


def load_split(cache, which):
    return [Data(species=f["species"], pos=f["pos"], energy=torch.tensor([f["energy"]], dtype=torch.float64),
                 force=f["force"], mol=torch.tensor([f["mol"]]))
            for f in cache["frames"] if f["split"] == which]


class Interaction(nn.Module):
    def __init__(self, dim, n_rbf):
        super().__init__()
        self.filt = nn.Sequential(nn.Linear(n_rbf, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.lin = nn.Linear(dim, dim, bias=False)
        self.upd = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, h, ei, rbf):
        src, dst = ei
        return h + self.upd(scatter(self.lin(h)[src] * self.filt(rbf), dst, dim=0, dim_size=h.size(0)))


class Model(nn.Module):
    def __init__(self, n_mol, dim=128, n_rbf=20, layers=4, cutoff=5.0):
        super().__init__()
        self.cutoff = cutoff
        self.emb = nn.Embedding(len(Z_INDEX), dim)
        self.register_buffer("freq", torch.arange(1, n_rbf + 1) * math.pi / cutoff)
        self.blocks = nn.ModuleList([Interaction(dim, n_rbf) for _ in range(layers)])
        self.out = nn.Sequential(nn.Linear(dim, dim // 2), nn.SiLU(), nn.Linear(dim // 2, 1))
        # one energy offset per molecule (rMD17 energies are absolute and differ by 1e5 kcal/mol)
        self.register_buffer("mol_offset", torch.zeros(n_mol, dtype=torch.float64))

    def forward(self, d):
        pos = d.pos.requires_grad_(True)
        ei = radius_graph(pos, r=self.cutoff, batch=d.batch, max_num_neighbors=32)
        r = (pos[ei[0]] - pos[ei[1]]).norm(dim=-1, keepdim=True)
        env = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0)
        rbf = torch.sin(self.freq * r) / r * env
        h = self.emb(d.species)
        for blk in self.blocks:
            h = blk(h, ei, rbf)
        e = scatter(self.out(h).squeeze(-1), d.batch, dim=0, dim_size=d.num_graphs).double()
        forces = -torch.autograd.grad(e.sum(), pos, create_graph=self.training)[0]
        return e + self.mol_offset[d.mol], forces


def gather_variable(t, world):
    """all_gather for 1-D tensors whose length differs between ranks."""
    n = torch.tensor([t.numel()], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros(max_n, dtype=t.dtype, device=t.device)
    padded[:t.numel()] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:int(s.item())] for o, s in zip(out, sizes)])


def evaluate(net, loader, n_mol, world, device):
    net.eval()
    table = torch.zeros(n_mol, 4, dtype=torch.float64, device=device)  # |dE|, |dF|, frames, components
    atom_err = []
    for d in loader:
        d = d.to(device)
        e, f = net(d)
        de = (e.detach() - d.energy).abs()
        df = (f.detach() - d.force).abs()
        table[:, 0].index_add_(0, d.mol, de)
        table[:, 1].index_add_(0, d.mol[d.batch], df.sum(-1).double())
        table[:, 2].index_add_(0, d.mol, torch.ones_like(de))
        table[:, 3].index_add_(0, d.mol[d.batch], torch.full_like(df[:, 0], 3.0).double())
        atom_err.append(df.norm(dim=-1))
    dist.all_reduce(table)
    local = torch.cat(atom_err) if atom_err else torch.zeros(0, device=device)
    all_err = gather_variable(local, world)
    return table, all_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--npz-dir", required=True)
    ap.add_argument("--cache", default="data/rmd17/rmd17_all.pt")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--force-weight", type=float, default=50.0)
    ap.add_argument("--out", default="runs/rmd17_joint")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not os.path.exists(args.cache):
            build_cache(args.npz_dir, args.cache)
    dist.barrier()
    cache = torch.load(args.cache)
    names = cache["names"]
    train, val, test = (load_split(cache, s) for s in (0, 1, 2))
    del cache

    model = Model(len(names)).to(device)
    sums = torch.zeros(len(names), dtype=torch.float64)
    cnt = torch.zeros(len(names), dtype=torch.float64)
    for d in train:
        sums[d.mol] += d.energy
        cnt[d.mol] += 1
    model.mol_offset.copy_((sums / cnt).to(device))
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train, shuffle=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    val_loader = DataLoader(val[rank::world], batch_size=64)
    test_loader = DataLoader(test[rank::world], batch_size=64)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for d in train_loader:
            d = d.to(device, non_blocking=True)
            e, f = model(d)
            loss = ((e - d.energy) ** 2).mean() + args.force_weight * ((f - d.force) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        if (epoch + 1) % 25 == 0:
            table, _ = evaluate(model.module, val_loader, len(names), world, device)
            if rank == 0:
                f_mae = (table[:, 1].sum() / table[:, 3].sum()).item()
                print(f"epoch {epoch + 1}: val force MAE {f_mae * KCAL_MOL_TO_MEV:.1f} meV/A", flush=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
            dist.barrier()

    table, all_err = evaluate(model.module, test_loader, len(names), world, device)
    if rank == 0:
        print(f"{'molecule':>16s} {'E MAE':>8s} {'F MAE':>8s}  (meV, meV/A)")
        for k, name in enumerate(names):
            e_mae = table[k, 0] / table[k, 2] * KCAL_MOL_TO_MEV
            f_mae = table[k, 1] / table[k, 3] * KCAL_MOL_TO_MEV
            print(f"{name:>16s} {e_mae:8.2f} {f_mae:8.2f}")
        q = torch.quantile(all_err.float(), torch.tensor([0.5, 0.9, 0.99], device=device)) * KCAL_MOL_TO_MEV
        print(f"per-atom |dF| over {all_err.numel()} atoms: median {q[0]:.1f}, p90 {q[1]:.1f}, p99 {q[2]:.1f}, "
              f"max {all_err.max() * KCAL_MOL_TO_MEV:.1f} meV/A")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
