#!/usr/bin/env python
# MeshGraphNets, cylinder_flow (incompressible NS around a cylinder).
# Data: converted from the DeepMind tfrecords to one HDF5 file per split,
# one group per trajectory (mesh_pos, cells, node_type, velocity, pressure).
#
# launch:  torchrun --standalone --nproc_per_node=8 02_mgn_cylinder_flow.py --config cfg/cylinder.yaml
import argparse
import enum
import logging
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_scatter import scatter_add

log = logging.getLogger("mgn")


class NodeType(enum.IntEnum):
    NORMAL = 0
    OBSTACLE = 1
    AIRFOIL = 2
    HANDLE = 3
    INFLOW = 4
    OUTFLOW = 5
    WALL_BOUNDARY = 6
    SIZE = 9


def mlp(in_dim, out_dim, hidden=128, layers=2, norm=True):
    mods, d = [], in_dim
    for _ in range(layers):
        mods += [nn.Linear(d, hidden), nn.ReLU()]
        d = hidden
    mods.append(nn.Linear(d, out_dim))
    if norm:
        mods.append(nn.LayerNorm(out_dim))
    return nn.Sequential(*mods)


class GraphNetBlock(nn.Module):
    def __init__(self, latent):
        super().__init__()
        self.edge_mlp = mlp(3 * latent, latent)
        self.node_mlp = mlp(2 * latent, latent)

    def forward(self, x, e, edge_index):
        s, r = edge_index
        e_upd = self.edge_mlp(torch.cat([x[s], x[r], e], -1))
        x_upd = self.node_mlp(torch.cat([x, scatter_add(e_upd, r, dim=0, dim_size=x.shape[0])], -1))
        return x + x_upd, e + e_upd


class MeshGraphNet(nn.Module):
    def __init__(self, node_in, edge_in, out_dim, latent=128, mp_steps=15):
        super().__init__()
        self.node_enc = mlp(node_in, latent)
        self.edge_enc = mlp(edge_in, latent)
        self.blocks = nn.ModuleList(GraphNetBlock(latent) for _ in range(mp_steps))
        self.dec = mlp(latent, out_dim, norm=False)

    def forward(self, x, e, edge_index):
        x, e = self.node_enc(x), self.edge_enc(e)
        for blk in self.blocks:
            x, e = blk(x, e, edge_index)
        return self.dec(x)


def cells_to_edges(cells):
    e = np.concatenate([cells[:, [0, 1]], cells[:, [1, 2]], cells[:, [2, 0]]], 0)
    e = np.unique(np.sort(e, axis=1), axis=0)
    return np.concatenate([e, e[:, ::-1]], 0).T.copy()


def node_edge_features(vel, node_type, mesh_pos, edge_index):
    one_hot = F.one_hot(node_type, NodeType.SIZE).float()
    rel = mesh_pos[edge_index[0]] - mesh_pos[edge_index[1]]
    return torch.cat([vel, one_hot], -1), torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1)


class CylinderFlow(Dataset):
    def __init__(self, h5_path, noise_std=0.0):
        self.h5_path, self.noise_std = h5_path, noise_std
        self._h5 = None
        with h5py.File(h5_path, "r") as f:
            self.keys = sorted(f.keys())
            self.lengths = [f[k]["velocity"].shape[0] - 1 for k in self.keys]
        self.offsets = np.cumsum([0] + self.lengths)

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, idx):
        if self._h5 is None:
            self._h5 = h5py.File(self.h5_path, "r")
        ti = int(np.searchsorted(self.offsets, idx, side="right") - 1)
        t = idx - self.offsets[ti]
        g = self._h5[self.keys[ti]]
        vel = torch.from_numpy(g["velocity"][t:t + 2]).float()
        node_type = torch.from_numpy(g["node_type"][()]).long().view(-1)
        mesh_pos = torch.from_numpy(g["mesh_pos"][()]).float()
        edge_index = torch.from_numpy(cells_to_edges(g["cells"][()])).long()
        cur, nxt = vel[0], vel[1]
        if self.noise_std > 0:
            noise = torch.randn_like(cur) * self.noise_std
            noise[node_type != NodeType.NORMAL] = 0.0
            cur = cur + noise
        return cur, nxt - cur, node_type, mesh_pos, edge_index


def collate_graphs(samples):
    xs, ys, nts, mps, eis, off = [], [], [], [], [], 0
    for cur, target, nt, mp, ei in samples:
        xs.append(cur); ys.append(target); nts.append(nt); mps.append(mp)
        eis.append(ei + off)
        off += cur.shape[0]
    return torch.cat(xs), torch.cat(ys), torch.cat(nts), torch.cat(mps), torch.cat(eis, 1)


def compute_stats(h5_path, max_traj=None):
    """Mean / std of node inputs, edge inputs and targets over the training split."""
    acc = {k: [0.0, 0.0, 0] for k in ("node", "edge", "out")}
    with h5py.File(h5_path, "r") as f:
        for k in sorted(f.keys())[:max_traj]:
            g = f[k]
            nt = torch.from_numpy(g["node_type"][()]).long().view(-1)
            mp = torch.from_numpy(g["mesh_pos"][()]).float()
            ei = torch.from_numpy(cells_to_edges(g["cells"][()])).long()
            vel = torch.from_numpy(g["velocity"][()]).float()
            for t in range(vel.shape[0] - 1):
                x, e = node_edge_features(vel[t], nt, mp, ei)
                for name, v in (("node", x), ("edge", e), ("out", vel[t + 1] - vel[t])):
                    acc[name][0] = acc[name][0] + v.sum(0).double()
                    acc[name][1] = acc[name][1] + (v.double() ** 2).sum(0)
                    acc[name][2] += v.shape[0]
    out = {}
    for name, (s, sq, n) in acc.items():
        mean = s / n
        out[f"{name}_mean"] = mean.float().numpy()
        out[f"{name}_std"] = torch.sqrt((sq / n - mean ** 2).clamp(min=1e-8)).float().numpy()
    return out


def load_stats(cfg):
    path = os.path.join(cfg["data_dir"], "stats_train.npz")
    if not os.path.exists(path):
        stats = compute_stats(os.path.join(cfg["data_dir"], "train.h5"), cfg.get("stats_traj"))
        np.savez(path, **stats)
    return {k: torch.from_numpy(v) for k, v in np.load(path).items()}


@torch.no_grad()
def rollout_rmse(model, stats, g, device, steps):
    nt = torch.from_numpy(g["node_type"][()]).long().view(-1).to(device)
    mp = torch.from_numpy(g["mesh_pos"][()]).float().to(device)
    ei = torch.from_numpy(cells_to_edges(g["cells"][()])).long().to(device)
    gt = torch.from_numpy(g["velocity"][()]).float().to(device)
    steps = min(steps, gt.shape[0] - 1)
    keep = ((nt == NodeType.NORMAL) | (nt == NodeType.OUTFLOW)).unsqueeze(-1)
    v, err = gt[0], []
    for t in range(steps):
        x, e = node_edge_features(v, nt, mp, ei)
        x = (x - stats["node_mean"]) / stats["node_std"]
        e = (e - stats["edge_mean"]) / stats["edge_std"]
        dv = model(x, e, ei) * stats["out_std"] + stats["out_mean"]
        v = torch.where(keep, v + dv, gt[t + 1])
        err.append(((v - gt[t + 1]) ** 2).mean().sqrt().item())
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    stats = {k: v.to(device) for k, v in load_stats(cfg).items()}
    train_ds = CylinderFlow(os.path.join(cfg["data_dir"], "train.h5"), noise_std=cfg["noise_std"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                        collate_fn=collate_graphs, pin_memory=True, drop_last=True)

    model = MeshGraphNet(2 + NodeType.SIZE, 3, 2, cfg["latent"], cfg["mp_steps"]).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    # global batch = batch_size * world_size; lr in the config is for the global batch
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg["lr_decay"])

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    os.makedirs(cfg["out_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        run_loss, n_batches = torch.zeros((), device=device), 0
        for x_vel, target, nt, mp, ei in loader:
            x_vel, target = x_vel.to(device, non_blocking=True), target.to(device, non_blocking=True)
            nt, mp, ei = nt.to(device), mp.to(device), ei.to(device)
            x, e = node_edge_features(x_vel, nt, mp, ei)
            x = (x - stats["node_mean"]) / stats["node_std"]
            e = (e - stats["edge_mean"]) / stats["edge_std"]
            y = (target - stats["out_mean"]) / stats["out_std"]
            pred = model(x, e, ei)
            mask = (nt == NodeType.NORMAL) | (nt == NodeType.OUTFLOW)
            loss = ((pred - y) ** 2).sum(-1)[mask].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += loss.detach()
            n_batches += 1
        if epoch < cfg["decay_epochs"]:
            sched.step()
        dist.all_reduce(run_loss)
        if rank == 0:
            log.info("epoch %d  train loss %.5f  lr %.2e", epoch, run_loss.item() / (n_batches * world_size),
                     opt.param_groups[0]["lr"])

        if rank == 0 and (epoch + 1) % cfg["eval_every"] == 0:
            model.eval()
            with h5py.File(os.path.join(cfg["data_dir"], "valid.h5"), "r") as f:
                errs = [rollout_rmse(model.module, stats, f[k], device, cfg["rollout_steps"])
                        for k in sorted(f.keys())[:cfg["n_valid_traj"]]]
            errs = np.array(errs)
            log.info("epoch %d  rollout rmse@1 %.2e  @50 %.2e  @all %.2e", epoch,
                     errs[:, 0].mean(), errs[:, min(49, errs.shape[1] - 1)].mean(), errs.mean())
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
