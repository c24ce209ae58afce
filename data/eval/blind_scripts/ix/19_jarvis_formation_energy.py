"""Formation energy per atom on JARVIS-DFT 3D with a periodic SchNet-style model.

Periodic neighbours: every atom is replicated into the 27 surrounding cells and a
batched radius search (torch_cluster.radius) runs against the original atoms.

    torchrun --standalone --nproc_per_node=4 19_jarvis_formation_energy.py \
        --data /data/jarvis/dft_3d_2021.json --run_name schnet-pbc-fe
"""
import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from ase.data import atomic_numbers
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_scatter import scatter

OFFSETS = torch.tensor(list(itertools.product((-1, 0, 1), repeat=3)), dtype=torch.float32)


class JarvisDFT3D(Dataset):
    def __init__(self, path, key="formation_energy_peratom"):
        with open(path) as f:
            records = [r for r in json.load(f) if isinstance(r.get(key), (int, float))]
        self.graphs = []
        for r in records:
            a = r["atoms"]
            lattice = torch.tensor(a["lattice_mat"], dtype=torch.float32)
            coords = torch.tensor(a["coords"], dtype=torch.float32)
            pos = coords if a["cartesian"] else coords @ lattice
            z = torch.tensor([atomic_numbers[e] for e in a["elements"]], dtype=torch.long)
            self.graphs.append(Data(z=z, pos=pos, cell=lattice.unsqueeze(0), y=torch.tensor([float(r[key])]),
                                    jid=r["jid"]))

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


@torch.no_grad()
def pbc_edges(pos, cell, batch, cutoff, max_neighbors=48):
    n_img = OFFSETS.size(0)
    images = OFFSETS.to(pos)
    shifts = torch.einsum("mk,bkl->bml", images, cell)                 # [B, 27, 3]
    rep_pos = (pos.unsqueeze(1) + shifts[batch]).reshape(-1, 3)        # [N*27, 3]
    rep_batch = batch.repeat_interleave(n_img)
    rep_atom = torch.arange(pos.size(0), device=pos.device).repeat_interleave(n_img)
    rep_img = torch.arange(n_img, device=pos.device).repeat(pos.size(0))
    dst, rep = radius(rep_pos, pos, cutoff, rep_batch, batch, max_num_neighbors=max_neighbors)
    src, img = rep_atom[rep], images[rep_img[rep]]
    keep = ~((src == dst) & (img.abs().sum(-1) == 0))
    return torch.stack([src[keep], dst[keep]]), img[keep]


class CFConv(nn.Module):
    def __init__(self, dim, n_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.net = nn.Sequential(nn.Linear(n_rbf, dim), nn.Softplus(), nn.Linear(dim, dim))
        self.lin1 = nn.Linear(dim, dim, bias=False)
        self.lin2 = nn.Sequential(nn.Linear(dim, dim), nn.Softplus(), nn.Linear(dim, dim))

    def forward(self, h, edge_index, d, rbf):
        w = self.net(rbf) * (0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)).unsqueeze(-1)
        agg = scatter(self.lin1(h)[edge_index[0]] * w, edge_index[1], dim=0, dim_size=h.size(0), reduce="mean")
        return h + self.lin2(agg)


class PeriodicSchNet(nn.Module):
    def __init__(self, dim=128, n_inter=4, n_rbf=64, cutoff=8.0):
        super().__init__()
        self.cutoff = cutoff
        self.emb = nn.Embedding(100, dim)
        self.register_buffer("mu", torch.linspace(0, cutoff, n_rbf))
        self.inter = nn.ModuleList(CFConv(dim, n_rbf, cutoff) for _ in range(n_inter))
        self.out = nn.Sequential(nn.Linear(dim, dim // 2), nn.Softplus(), nn.Linear(dim // 2, 1))

    def forward(self, data):
        edge_index, img = pbc_edges(data.pos, data.cell, data.batch, self.cutoff)
        shift = torch.einsum("ek,ekl->el", img, data.cell[data.batch[edge_index[0]]])
        d = (data.pos[edge_index[0]] + shift - data.pos[edge_index[1]]).norm(dim=-1)
        rbf = torch.exp(-0.5 * ((d.unsqueeze(-1) - self.mu) / (self.mu[1] - self.mu[0])) ** 2)
        h = self.emb(data.z)
        for blk in self.inter:
            h = blk(h, edge_index, d, rbf)
        return scatter(self.out(h).squeeze(-1), data.batch, dim=0, reduce="mean")  # per-atom quantity


@torch.no_grad()
def mae(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device)
        t[0] += (model(data) - data.y).abs().sum()
        t[1] += data.num_graphs
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--project", default="jarvis-fe")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="checkpoints/jarvis_fe")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    ds = JarvisDFT3D(args.data)
    # standard JARVIS 80/10/10 split with a fixed seed
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(123)).tolist()
    n_tr, n_va = int(0.8 * len(ds)), int(0.1 * len(ds))
    train_set = Subset(ds, perm[:n_tr])
    val_set = Subset(ds, perm[n_tr:n_tr + n_va][rank::world])
    test_set = Subset(ds, perm[n_tr + n_va:][rank::world])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=128)
    test_loader = DataLoader(test_set, batch_size=128)

    model = DDP(PeriodicSchNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            loss = F.l1_loss(model(data), data.y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * data.num_graphs, torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(tot)
        val_mae = mae(model, val_loader, device)
        if rank == 0:
            wandb.log({"epoch": epoch, "train_mae": (tot[0] / tot[1]).item(), "val_mae": val_mae,
                       "lr": sched.get_last_lr()[0], "time": time.time() - t0})
            if val_mae < best:
                best = val_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device)["model"])
    test_mae = mae(model, test_loader, device)
    if rank == 0:
        wandb.log({"test_mae": test_mae, "best_val_mae": best})
        print(f"test MAE {test_mae:.4f} eV/atom (best val {best:.4f})")
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
