"""PaiNN on QM9, energy (U0) or dipole-moment magnitude, with DDP.

Example:
    torchrun --standalone --nproc_per_node=8 07_qm9_painn_dipole.py --target mu --root /data/qm9
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_scatter import scatter

log = logging.getLogger("painn")
TARGET_COL = {"mu": 0, "U0": 7}


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class RadialBasis(nn.Module):
    def __init__(self, num_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("freq", torch.arange(1, num_rbf + 1).float() * math.pi / cutoff)

    def forward(self, d):
        d = d.unsqueeze(-1)
        env = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        return torch.sin(self.freq * d) / d * env


class PaiNNLayer(nn.Module):
    def __init__(self, F_, num_rbf):
        super().__init__()
        self.F = F_
        self.msg_mlp = nn.Sequential(nn.Linear(F_, F_), nn.SiLU(), nn.Linear(F_, 3 * F_))
        self.msg_rbf = nn.Linear(num_rbf, 3 * F_)
        self.U = nn.Linear(F_, F_, bias=False)
        self.V = nn.Linear(F_, F_, bias=False)
        self.upd_mlp = nn.Sequential(nn.Linear(2 * F_, F_), nn.SiLU(), nn.Linear(F_, 3 * F_))
        self.ln = nn.LayerNorm(F_)

    def forward(self, s, v, edge_index, rbf, unit):
        j, i = edge_index
        x = self.msg_mlp(self.ln(s))[j] * self.msg_rbf(rbf)
        ds, dvv, dvs = x.split(self.F, dim=-1)
        dv = dvv.unsqueeze(1) * v[j] + dvs.unsqueeze(1) * unit.unsqueeze(-1)
        s = s + scatter(ds, i, dim=0, dim_size=s.size(0))
        v = v + scatter(dv, i, dim=0, dim_size=v.size(0))

        Uv, Vv = self.U(v), self.V(v)
        a = self.upd_mlp(torch.cat([s, torch.sqrt((Vv ** 2).sum(1) + 1e-8)], dim=-1))
        avv, asv, ass = a.split(self.F, dim=-1)
        return s + asv * (Uv * Vv).sum(1) + ass, v + avv.unsqueeze(1) * Uv


class PaiNN(nn.Module):
    def __init__(self, F_=128, layers=3, num_rbf=20, cutoff=5.0, target="mu"):
        super().__init__()
        self.F, self.cutoff, self.target = F_, cutoff, target
        self.embed = nn.Embedding(10, F_)
        self.rbf = RadialBasis(num_rbf, cutoff)
        self.layers = nn.ModuleList(PaiNNLayer(F_, num_rbf) for _ in range(layers))
        self.q_head = nn.Sequential(nn.Linear(F_, F_), nn.SiLU(), nn.Linear(F_, 1))  # atomic charges / energies
        # atomic dipoles, only needed for the dipole target
        self.v_head = nn.Linear(F_, 1, bias=False) if target == "mu" else None

    def forward(self, z, pos, batch):
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        vec = pos[edge_index[0]] - pos[edge_index[1]]
        d = vec.norm(dim=-1)
        s = self.embed(z)
        v = s.new_zeros(s.size(0), 3, self.F)
        rbf, unit = self.rbf(d), vec / d.unsqueeze(-1)
        for layer in self.layers:
            s, v = layer(s, v, edge_index, rbf, unit)
        q = self.q_head(s)
        if self.target == "U0":
            return scatter(q.squeeze(-1), batch, dim=0, reduce="sum")
        # dipole = sum_i (q_i r_i + mu_i), charges made neutral per molecule
        q = q - scatter(q, batch, dim=0, reduce="mean")[batch]
        mu = scatter(q * pos + self.v_head(v).squeeze(-1), batch, dim=0, reduce="sum")
        return mu.norm(dim=-1)


@torch.no_grad()
def evaluate(model, loader, col, device):
    model.eval()
    t = torch.zeros(2, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device)
        pred = model(data.z, data.pos, data.batch)
        t[0] += (pred - data.y[:, col]).abs().sum()
        t[1] += data.num_graphs
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/qm9")
    p.add_argument("--target", choices=list(TARGET_COL), default="mu")
    p.add_argument("--epochs", type=int, default=600)
    p.add_argument("--bs", type=int, default=50)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--n_train", type=int, default=110000)
    p.add_argument("--n_val", type=int, default=10000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="runs/painn")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    # different seed per rank so dropout / augmentation noise is not identical across GPUs
    seed_everything(args.seed + rank)

    if rank == 0:
        QM9(args.root)  # download + process once
    dist.barrier()
    dataset = QM9(args.root)

    perm = torch.randperm(len(dataset))
    train_set = Subset(dataset, perm[: args.n_train].tolist())
    val_set = Subset(dataset, perm[args.n_train: args.n_train + args.n_val].tolist())
    test_set = Subset(dataset, perm[args.n_train + args.n_val:].tolist())
    log.info("train %d / val %d / test %d molecules", len(train_set), len(val_set), len(test_set))

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=200)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=200)

    col = TARGET_COL[args.target]
    model = DDP(PaiNN(target=args.target).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=15, min_lr=1e-6)

    os.makedirs(args.out, exist_ok=True)
    best, best_path = float("inf"), os.path.join(args.out, f"painn_{args.target}_best.pt")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for data in loader:
            data = data.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(data.z, data.pos, data.batch), data.y[:, col])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()

        val_mae = evaluate(model, val_loader, col, device)
        plateau.step(val_mae)
        log.info("epoch %d val MAE %.5f lr %.2e", epoch, val_mae, opt.param_groups[0]["lr"])
        if val_mae < best:
            best = val_mae
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_mae": val_mae}, best_path)
        dist.barrier()

    model.module.load_state_dict(torch.load(best_path, map_location=device)["model"])
    log.info("test MAE %.5f (best val %.5f)", evaluate(model, test_loader, col, device), best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
