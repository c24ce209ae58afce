# -*- coding: utf-8 -*-
"""
MeshGraphNets for compressible flow around an airfoil (the `airfoil` dataset).

Predicts velocity and density increments plus pressure at t+1.  Validation runs a
full autoregressive rollout over the validation trajectories and keeps the
checkpoint with the lowest rollout RMSE.

    srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
         --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
         07_mgn_airfoil.py --data /lustre/mgn/airfoil --work-dir /lustre/$USER/airfoil
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_scatter import scatter_add

NORMAL, AIRFOIL, INFLOW, OUTFLOW, WALL = 0, 2, 4, 5, 6
NUM_TYPES = 9


class Normalizer(nn.Module):
    def __init__(self, size, max_accumulations=10 ** 5, eps=1e-8):
        super().__init__()
        self.max_acc, self.eps = max_accumulations, eps
        self.register_buffer("count", torch.zeros(1, dtype=torch.float64))
        self.register_buffer("n_acc", torch.zeros(1, dtype=torch.long))
        self.register_buffer("s1", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("s2", torch.zeros(size, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x):
        buf = torch.cat([x.double().sum(0), x.double().pow(2).sum(0), x.new_tensor([x.shape[0]]).double()])
        dist.all_reduce(buf)
        d = self.s1.numel()
        self.s1 += buf[:d]
        self.s2 += buf[d:2 * d]
        self.count += buf[-1]
        self.n_acc += 1

    def forward(self, x, accumulate):
        if accumulate and int(self.n_acc) < self.max_acc:
            self.update(x)
        return (x - self.mean) / self.std

    def inverse(self, x):
        return x * self.std + self.mean

    @property
    def mean(self):
        return (self.s1 / self.count.clamp(min=1)).float()

    @property
    def std(self):
        c = self.count.clamp(min=1)
        return ((self.s2 / c - (self.s1 / c) ** 2).clamp(min=0).sqrt().float()).clamp(min=self.eps)


def mlp(i, o, h=128, ln=True):
    layers = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    if ln:
        layers.append(nn.LayerNorm(o))
    return nn.Sequential(*layers)


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.e = mlp(3 * h, h)
        self.n = mlp(2 * h, h)

    def forward(self, x, e, ei):
        de = self.e(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        dx = self.n(torch.cat([x, scatter_add(de, ei[1], 0, dim_size=x.shape[0])], -1))
        return x + dx, e + de


class AirfoilModel(nn.Module):
    def __init__(self, latent=128, steps=15):
        super().__init__()
        self.node_norm = Normalizer(3 + NUM_TYPES)
        self.edge_norm = Normalizer(3)
        self.out_norm = Normalizer(4)
        self.enc_n, self.enc_e = mlp(3 + NUM_TYPES, latent), mlp(3, latent)
        self.proc = nn.ModuleList([Block(latent) for _ in range(steps)])
        self.dec = mlp(latent, 4, ln=False)

    def _graph(self, vel, rho, nt, mesh_pos, ei):
        x = torch.cat([vel, rho, F.one_hot(nt, NUM_TYPES).float()], -1)
        rel = mesh_pos[ei[0]] - mesh_pos[ei[1]]
        return x, torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1)

    def _run(self, x, e, ei):
        x, e = self.enc_n(x), self.enc_e(e)
        for b in self.proc:
            x, e = b(x, e, ei)
        return self.dec(x)

    def forward(self, vel, rho, nt, mesh_pos, ei, target):
        x, e = self._graph(vel, rho, nt, mesh_pos, ei)
        out = self._run(self.node_norm(x, self.training), self.edge_norm(e, self.training), ei)
        tgt = self.out_norm(target, self.training)
        return ((out - tgt) ** 2).sum(-1)[nt == NORMAL].mean()

    @torch.no_grad()
    def predict(self, vel, rho, nt, mesh_pos, ei):
        x, e = self._graph(vel, rho, nt, mesh_pos, ei)
        out = self.out_norm.inverse(self._run(self.node_norm(x, False), self.edge_norm(e, False), ei))
        return vel + out[:, :2], rho + out[:, 2:3], out[:, 3:4]


def edges_from_cells(cells):
    e = np.vstack([cells[:, [0, 1]], cells[:, [1, 2]], cells[:, [2, 0]]])
    e = np.unique(np.sort(e, 1), axis=0)
    return torch.from_numpy(np.vstack([e, e[:, ::-1]]).T.copy()).long()


class Trajectories(Dataset):
    """Index = trajectory; one folder of .npy arrays per trajectory (mesh_pos, cells, node_type,
    velocity, density, pressure). Time-dependent arrays are memory-mapped."""

    def __init__(self, folder):
        self.dirs = sorted(os.path.join(folder, d) for d in os.listdir(folder)
                           if os.path.isdir(os.path.join(folder, d)))
        self._static = {}

    def __len__(self):
        return len(self.dirs)

    def static(self, i):
        if i not in self._static:
            d = self.dirs[i]
            self._static[i] = {
                "mesh_pos": torch.from_numpy(np.load(os.path.join(d, "mesh_pos.npy"))).float(),
                "edges": edges_from_cells(np.load(os.path.join(d, "cells.npy"))),
                "node_type": torch.from_numpy(np.load(os.path.join(d, "node_type.npy"))).long().view(-1),
            }
        return self._static[i]

    def field(self, i, name):
        return np.load(os.path.join(self.dirs[i], f"{name}.npy"), mmap_mode="r")

    def __getitem__(self, i):
        out = dict(self.static(i))
        for name in ("velocity", "density", "pressure"):
            out[name] = torch.from_numpy(np.ascontiguousarray(self.field(i, name))).float()
        return out


class Steps(Dataset):
    def __init__(self, traj_ds, noise_vel=10.0, noise_rho=0.01):
        self.traj_ds = traj_ds
        self.noise_vel, self.noise_rho = noise_vel, noise_rho
        self.T = traj_ds.field(0, "velocity").shape[0] - 1

    def __len__(self):
        return len(self.traj_ds) * self.T

    def __getitem__(self, idx):
        i, t = idx // self.T, idx % self.T
        st = self.traj_ds.static(i)
        vel = torch.from_numpy(np.array(self.traj_ds.field(i, "velocity")[t:t + 2])).float()
        den = torch.from_numpy(np.array(self.traj_ds.field(i, "density")[t:t + 2])).float()
        prs = torch.from_numpy(np.array(self.traj_ds.field(i, "pressure")[t + 1])).float()
        v, rho = vel[0], den[0]
        normal = (st["node_type"] == NORMAL).unsqueeze(-1)
        v = v + torch.randn_like(v) * self.noise_vel * normal
        rho = rho + torch.randn_like(rho) * self.noise_rho * normal
        target = torch.cat([vel[1] - v, den[1] - rho, prs], -1)
        return v, rho, st["node_type"], st["mesh_pos"], st["edges"], target


def collate(samples):
    cols, off = [[] for _ in range(6)], 0
    for s in samples:
        for j, val in enumerate(s):
            cols[j].append(val + off if j == 4 else val)
        off += s[0].shape[0]
    return [torch.cat(c, 1 if j == 4 else 0) for j, c in enumerate(cols)]


@torch.no_grad()
def rollout_rmse(model, tr, device):
    nt = tr["node_type"].to(device)
    mp, ei = tr["mesh_pos"].to(device), tr["edges"].to(device)
    gv, gr = tr["velocity"].to(device), tr["density"].to(device)
    v, rho = gv[0], gr[0]
    free = (nt == NORMAL).unsqueeze(-1)
    se = []
    for t in range(gv.shape[0] - 1):
        v_new, rho_new, _ = model.predict(v, rho, nt, mp, ei)
        v = torch.where(free, v_new, gv[t + 1])
        rho = torch.where(free, rho_new, gr[t + 1])
        se.append(((v - gv[t + 1]) ** 2).sum(-1).mean())
    return torch.stack(se).mean().sqrt()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=30)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_steps = Steps(Trajectories(os.path.join(args.data, "train")))
    tsampler = DistributedSampler(train_steps, shuffle=True)
    tloader = DataLoader(train_steps, batch_size=args.batch_size, sampler=tsampler, num_workers=8,
                         collate_fn=collate, pin_memory=True, prefetch_factor=4)
    valid = Trajectories(os.path.join(args.data, "valid"))
    vsampler = DistributedSampler(valid, shuffle=False)
    vloader = DataLoader(valid, batch_size=None, sampler=vsampler, num_workers=2)

    core = AirfoilModel().to(device)
    model = DDP(core, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)

    best = float("inf")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(args.epochs):
        tsampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for batch in tloader:
            v, rho, nt, mp, ei, target = [b.to(device, non_blocking=True) for b in batch]
            loss = model(v, rho, nt, mp, ei, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.stack([loss.detach(), torch.ones_like(loss)])
        sched.step()
        dist.all_reduce(loss_sum)

        core.eval()
        rmses = [rollout_rmse(core, tr, device).item() for tr in vloader]
        val_rmse = float(np.mean(rmses))

        if rank == 0:
            print(f"epoch {epoch:3d}  train {loss_sum[0].item() / loss_sum[1].item():.4e}  "
                  f"valid rollout rmse {val_rmse:.4e}", flush=True)
            state = {"model": core.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "val_rmse": val_rmse}
            torch.save(state, os.path.join(args.work_dir, "last.pt"))
            if val_rmse < best:
                best = val_rmse
                torch.save(state, os.path.join(args.work_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
