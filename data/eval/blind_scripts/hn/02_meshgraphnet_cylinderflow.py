"""MeshGraphNets (Pfaff et al. 2021) on the cylinder_flow dataset, PyTorch + DDP.

The TFRecords were converted once to HDF5: one group per trajectory holding
mesh_pos [N,2], cells [C,3], node_type [N,1], velocity [T,N,2], pressure [T,N,1].

    torchrun --nproc_per_node=8 02_meshgraphnet_cylinderflow.py --data-dir /datasets/cylinder_flow_h5
"""
import argparse
import json
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

NUM_NODE_TYPES = 9
NORMAL, INFLOW, OUTFLOW, WALL = 0, 4, 5, 6


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out-dir", default="checkpoints/mgn_cylinder")
    ap.add_argument("--latent", type=int, default=128)
    ap.add_argument("--mp-steps", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lr-final", type=float, default=1e-6)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--noise-std", type=float, default=2e-2)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--val-trajectories", type=int, default=16)
    ap.add_argument("--val-steps", type=int, default=50)
    return ap.parse_args()


def cells_to_edges(cells):
    e = np.concatenate([cells[:, [0, 1]], cells[:, [1, 2]], cells[:, [2, 0]]], axis=0)
    e = np.sort(e, axis=1)
    e = np.unique(e, axis=0)
    return np.concatenate([e, e[:, ::-1]], axis=0).T.copy()  # [2, E], both directions


class CylinderFlowSteps(Dataset):
    """Single-step samples (trajectory, t) -> velocity at t+1."""

    def __init__(self, path, noise_std=0.0, max_traj=None):
        self.path = path
        self.noise_std = noise_std
        with h5py.File(path, "r") as f:
            keys = sorted(f.keys(), key=int)
            if max_traj is not None:
                keys = keys[:max_traj]
            self.keys = keys
            self.T = f[keys[0]]["velocity"].shape[0]
        self.index = [(k, t) for k in self.keys for t in range(self.T - 1)]
        self._file = None

    def __len__(self):
        return len(self.index)

    def _h5(self):
        if self._file is None:  # open lazily, once per worker
            self._file = h5py.File(self.path, "r")
        return self._file

    def __getitem__(self, i):
        key, t = self.index[i]
        g = self._h5()[key]
        node_type = torch.from_numpy(g["node_type"][:, 0].astype(np.int64))
        vel = torch.from_numpy(g["velocity"][t].astype(np.float32))
        vel_next = torch.from_numpy(g["velocity"][t + 1].astype(np.float32))
        mesh_pos = torch.from_numpy(g["mesh_pos"][:].astype(np.float32))
        edges = torch.from_numpy(cells_to_edges(g["cells"][:]))
        if self.noise_std > 0:
            noise = torch.randn_like(vel) * self.noise_std
            noise[node_type != NORMAL] = 0.0
            vel = vel + noise
        return dict(node_type=node_type, velocity=vel, target=vel_next - vel,
                    mesh_pos=mesh_pos, edges=edges)


def collate_graphs(samples):
    out, offset, edges, batch = {}, 0, [], []
    for gi, s in enumerate(samples):
        edges.append(s["edges"] + offset)
        batch.append(torch.full((s["node_type"].shape[0],), gi, dtype=torch.long))
        offset += s["node_type"].shape[0]
    for k in ("node_type", "velocity", "target", "mesh_pos"):
        out[k] = torch.cat([s[k] for s in samples], dim=0)
    out["edges"] = torch.cat(edges, dim=1)
    out["batch"] = torch.cat(batch)
    return out


def mlp(din, dout, hidden=128, layer_norm=True):
    layers = [nn.Linear(din, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, dout)]
    if layer_norm:
        layers.append(nn.LayerNorm(dout))
    return nn.Sequential(*layers)


class GraphNetBlock(nn.Module):
    def __init__(self, latent):
        super().__init__()
        self.edge_mlp = mlp(3 * latent, latent, latent)
        self.node_mlp = mlp(2 * latent, latent, latent)

    def forward(self, h, e, edges):
        s, r = edges
        e_new = self.edge_mlp(torch.cat([e, h[s], h[r]], dim=-1))
        agg = torch.zeros_like(h).index_add_(0, r, e_new)
        h_new = self.node_mlp(torch.cat([h, agg], dim=-1))
        return h + h_new, e + e_new


class MeshGraphNet(nn.Module):
    def __init__(self, latent=128, mp_steps=15, out_dim=2):
        super().__init__()
        self.node_enc = mlp(2 + NUM_NODE_TYPES, latent, latent)
        self.edge_enc = mlp(3, latent, latent)
        self.blocks = nn.ModuleList([GraphNetBlock(latent) for _ in range(mp_steps)])
        self.decoder = mlp(latent, out_dim, latent, layer_norm=False)

    def forward(self, node_feat, edge_feat, edges):
        h, e = self.node_enc(node_feat), self.edge_enc(edge_feat)
        for blk in self.blocks:
            h, e = blk(h, e, edges)
        return self.decoder(h)


class Stats:
    """Feature normalisation statistics, computed once from the first training trajectories."""

    def __init__(self, ds, n_traj=10):
        with h5py.File(ds.path, "r") as f:
            vel, dvel, rel = [], [], []
            for k in ds.keys[:n_traj]:
                v = f[k]["velocity"][:]
                vel.append(v.reshape(-1, 2))
                dvel.append((v[1:] - v[:-1]).reshape(-1, 2))
                edges = cells_to_edges(f[k]["cells"][:])
                d = f[k]["mesh_pos"][:][edges[0]] - f[k]["mesh_pos"][:][edges[1]]
                rel.append(np.concatenate([d, np.linalg.norm(d, axis=1, keepdims=True)], axis=1))
        self.v_mean, self.v_std = [torch.tensor(x, dtype=torch.float32) for x in (np.mean(np.concatenate(vel), 0), np.std(np.concatenate(vel), 0))]
        self.dv_mean, self.dv_std = [torch.tensor(x, dtype=torch.float32) for x in (np.mean(np.concatenate(dvel), 0), np.std(np.concatenate(dvel), 0))]
        self.e_mean, self.e_std = [torch.tensor(x, dtype=torch.float32) for x in (np.mean(np.concatenate(rel), 0), np.std(np.concatenate(rel), 0))]

    def to(self, device):
        for k, v in vars(self).items():
            setattr(self, k, v.to(device))
        return self


def build_inputs(b, stats):
    s, r = b["edges"]
    rel = b["mesh_pos"][s] - b["mesh_pos"][r]
    edge_feat = torch.cat([rel, rel.norm(dim=-1, keepdim=True)], dim=-1)
    edge_feat = (edge_feat - stats.e_mean) / (stats.e_std + 1e-8)
    vel = (b["velocity"] - stats.v_mean) / (stats.v_std + 1e-8)
    onehot = torch.nn.functional.one_hot(b["node_type"], NUM_NODE_TYPES).float()
    return torch.cat([vel, onehot], dim=-1), edge_feat


@torch.no_grad()
def rollout_error(net, path, keys, stats, steps, device):
    """Autoregressive velocity RMSE over `steps` for the given trajectories."""
    sq_err, count = 0.0, 0
    with h5py.File(path, "r") as f:
        for k in keys:
            g = f[k]
            node_type = torch.from_numpy(g["node_type"][:, 0].astype(np.int64)).to(device)
            mesh_pos = torch.from_numpy(g["mesh_pos"][:].astype(np.float32)).to(device)
            edges = torch.from_numpy(cells_to_edges(g["cells"][:])).to(device)
            gt = torch.from_numpy(g["velocity"][: steps + 1].astype(np.float32)).to(device)
            vel = gt[0]
            mask = (node_type == NORMAL) | (node_type == OUTFLOW)
            for t in range(steps):
                b = dict(node_type=node_type, velocity=vel, mesh_pos=mesh_pos, edges=edges)
                nf, ef = build_inputs(b, stats)
                dv = net(nf, ef, edges) * stats.dv_std + stats.dv_mean
                vel = torch.where(mask.unsqueeze(-1), vel + dv, gt[t + 1])
                sq_err += ((vel - gt[t + 1]) ** 2).sum().item()
                count += vel.numel()
    return sq_err, count


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234)

    train_path = os.path.join(args.data_dir, "train.h5")
    valid_path = os.path.join(args.data_dir, "valid.h5")
    train_ds = CylinderFlowSteps(train_path, noise_std=args.noise_std)
    stats = Stats(train_ds).to(device)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers,
                        collate_fn=collate_graphs, pin_memory=True, persistent_workers=True, drop_last=True)

    with h5py.File(valid_path, "r") as f:
        val_keys = sorted(f.keys(), key=int)[: args.val_trajectories]
    my_val_keys = val_keys[rank::world]

    model = MeshGraphNet(args.latent, args.mp_steps).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(loader)
    gamma = (args.lr_final / args.lr) ** (1.0 / max(total_steps, 1))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=gamma)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as fh:
            json.dump(vars(args), fh, indent=2)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for b in loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            node_feat, edge_feat = build_inputs(b, stats)
            pred = model(node_feat, edge_feat, b["edges"])
            target = (b["target"] - stats.dv_mean) / (stats.dv_std + 1e-8)
            loss_mask = (b["node_type"] == NORMAL) | (b["node_type"] == OUTFLOW)
            loss = ((pred - target) ** 2).sum(-1)[loss_mask].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 500 == 0:
                print(f"step {step} loss {loss.item():.4e} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        se, n = rollout_error(model.module, valid_path, my_val_keys, stats, args.val_steps, device)
        tot = torch.tensor([se, n], dtype=torch.float64, device=device)
        dist.all_reduce(tot)
        dist.all_reduce(running)
        if rank == 0:
            rmse = (tot[0] / tot[1]).sqrt().item()
            print(f"epoch {epoch} | {time.time() - t0:.0f}s | train {running[0].item() / running[1].item():.4e}"
                  f" | rollout-{args.val_steps} RMSE {rmse:.4e}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out_dir, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
