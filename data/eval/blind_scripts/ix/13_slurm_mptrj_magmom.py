"""Energy / force / magnetic-moment model on MPtrj, multi-node with Slurm (one task per GPU).

Job script (sbatch):
    #SBATCH --nodes=4 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29512
    srun python 13_slurm_mptrj_magmom.py --data /lustre/proj/mptrj/mptrj_graphs.pt \
        --run_dir /lustre/proj/runs/magmom_$SLURM_JOB_ID

Only ~60% of MPtrj frames carry magnetic moments, so a batch may have none and the
magmom head is then skipped (hence find_unused_parameters=True).
"""
import argparse
import itertools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


def init_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class FrameDataset(Dataset):
    def __init__(self, path):
        self.frames = torch.load(path, map_location="cpu")  # list of dicts of CPU tensors

    def __len__(self):
        return len(self.frames)

    def __getitem__(self, i):
        f = self.frames[i]
        n = f["z"].numel()
        magmom = f.get("magmom")
        has_m = magmom is not None
        return Data(z=f["z"], pos=f["pos"], cell=f["cell"].view(1, 3, 3), natoms=torch.tensor([n]),
                    energy=f["energy"].view(1), forces=f["forces"],
                    magmom=magmom if has_m else torch.zeros(n), magmom_mask=torch.full((n,), has_m))


IMAGES = torch.tensor(list(itertools.product((-1, 0, 1), repeat=3)), dtype=torch.float32)


@torch.no_grad()
def pbc_graph(pos, cell, natoms, cutoff):
    dev = pos.device
    ptr = torch.cat([natoms.new_zeros(1), natoms.cumsum(0)])
    nsq = natoms * natoms
    g = torch.repeat_interleave(torch.arange(natoms.numel(), device=dev), nsq)
    k = torch.arange(int(nsq.sum()), device=dev) - torch.repeat_interleave(nsq.cumsum(0) - nsq, nsq)
    i, j = k // natoms[g] + ptr[g], k % natoms[g] + ptr[g]
    img = IMAGES.to(dev, pos.dtype)
    d = (pos[j, None] + torch.einsum("mk,bkl->bml", img, cell)[g] - pos[i, None]).norm(dim=-1)
    pair, m = torch.nonzero((d < cutoff) & (d > 1e-5), as_tuple=True)
    return torch.stack([j[pair], i[pair]]), img[m]


class Interaction(nn.Module):
    def __init__(self, dim, n_rbf):
        super().__init__()
        self.filter = nn.Sequential(nn.Linear(n_rbf, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.node = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, h, edge_index, rbf):
        msg = self.norm(h)[edge_index[0]] * self.filter(rbf)
        return h + self.node(scatter(msg, edge_index[1], dim=0, dim_size=h.size(0)))


class MagPotential(nn.Module):
    def __init__(self, dim=192, layers=5, n_rbf=24, cutoff=5.0):
        super().__init__()
        self.cutoff, self.n_rbf = cutoff, n_rbf
        self.emb = nn.Embedding(95, dim)
        self.layers = nn.ModuleList(Interaction(dim, n_rbf) for _ in range(layers))
        self.energy_head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))
        self.magmom_head = nn.Sequential(nn.Linear(dim, dim // 2), nn.SiLU(), nn.Linear(dim // 2, 1))

    def forward(self, data, with_magmom):
        pos = data.pos
        edge_index, img = pbc_graph(pos, data.cell, data.natoms, self.cutoff)
        shift = torch.einsum("ek,ekl->el", img, data.cell[data.batch[edge_index[0]]])
        d = (pos[edge_index[0]] + shift - pos[edge_index[1]]).norm(dim=-1)
        n = torch.arange(1, self.n_rbf + 1, device=d.device, dtype=d.dtype)
        env = 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1)
        rbf = torch.sin(n * math.pi * d[:, None] / self.cutoff) / d[:, None] * env[:, None]
        h = self.emb(data.z)
        for layer in self.layers:
            h = layer(h, edge_index, rbf)
        energy = scatter(self.energy_head(h).squeeze(-1), data.batch, dim=0, dim_size=data.num_graphs)
        magmom = self.magmom_head(h).squeeze(-1).abs() if with_magmom else None
        return energy, magmom


def step_losses(model, data, train):
    data.pos.requires_grad_(True)
    with_m = bool(data.magmom_mask.any())
    energy, magmom = model(data, with_magmom=with_m)
    forces = -torch.autograd.grad(energy.sum(), data.pos, create_graph=train)[0]
    nat = data.natoms.to(energy.dtype)
    out = {
        "e": (energy - data.energy).abs() / nat,
        "f": (forces - data.forces).abs(),
        "m": (magmom - data.magmom).abs()[data.magmom_mask] if with_m else None,
    }
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_dir", required=True, help="must be on the shared filesystem")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--w_e", type=float, default=1.0)
    ap.add_argument("--w_f", type=float, default=1.0)
    ap.add_argument("--w_m", type=float, default=0.1)
    args = ap.parse_args()

    rank, world, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    ds = FrameDataset(args.data)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(17)).tolist()
    n_val = len(ds) // 50
    train_set, val_ids = Subset(ds, perm[n_val:]), perm[:n_val]
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True)
    val_loader = DataLoader(Subset(ds, val_ids[rank::world]), batch_size=32, num_workers=2)

    net = MagPotential().to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    ckpt_path = os.path.join(args.run_dir, "checkpoint.pt")
    start = 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = state["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            l = step_losses(model, data, train=True)
            loss = args.w_e * l["e"].mean() + args.w_f * l["f"].mean()
            if l["m"] is not None:
                loss = loss + args.w_m * l["m"].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
        sched.step()

        net.eval()
        acc = torch.zeros(6, device=device, dtype=torch.float64)
        for data in val_loader:
            data = data.to(device)
            l = step_losses(net, data, train=False)
            acc[0] += l["e"].detach().sum(); acc[1] += l["e"].numel()
            acc[2] += l["f"].detach().sum(); acc[3] += l["f"].numel()
            if l["m"] is not None:
                acc[4] += l["m"].detach().sum(); acc[5] += l["m"].numel()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val: E {1000 * acc[0] / acc[1]:.1f} meV/atom, "
                  f"F {1000 * acc[2] / acc[3]:.1f} meV/A, magmom {acc[4] / acc[5].clamp(min=1):.3f} muB", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
