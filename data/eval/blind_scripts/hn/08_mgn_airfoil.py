"""MeshGraphNets, compressible flow around an airfoil (Pfaff et al., "airfoil").

The network predicts the rate of change of velocity and density; pressure is decoded
by its own head from the same latent (used for Cp plots / the eval script).

    torchrun --nproc_per_node=4 08_mgn_airfoil.py --data /scratch/mgn/airfoil --save /scratch/mgn/runs/airfoil
"""
import argparse
import os
import time
from collections import defaultdict

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_scatter import scatter_add

NODE_TYPES = 9
FIELDS = {"velocity": 2, "density": 1, "pressure": 1}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save", default="runs/airfoil")
    ap.add_argument("--loss-fields", default="velocity,density")
    ap.add_argument("--latent", type=int, default=128)
    ap.add_argument("--message-passing", type=int, default=15)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--noise", type=float, default=10.0, help="velocity noise std (m/s)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=200)
    return ap.parse_args()


def triangles_to_edges(cells):
    e = torch.cat([cells[:, 0:2], cells[:, 1:3], torch.stack([cells[:, 2], cells[:, 0]], 1)], 0)
    e = torch.unique(torch.sort(e, dim=1).values, dim=0)
    return torch.cat([e, e.flip(1)], 0).t().contiguous()


class AirfoilSteps(Dataset):
    def __init__(self, path, noise=0.0):
        self.path, self.noise = path, noise
        with h5py.File(path, "r") as f:
            self.trajs = sorted(f.keys())
            self.T = f[self.trajs[0]]["velocity"].shape[0]
        self.f = None

    def __len__(self):
        return len(self.trajs) * (self.T - 1)

    def __getitem__(self, idx):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        g = self.f[self.trajs[idx // (self.T - 1)]]
        t = idx % (self.T - 1)
        node_type = torch.from_numpy(g["node_type"][:, 0].astype(np.int64))
        cells = torch.from_numpy(g["cells"][:].astype(np.int64))
        s = {k: torch.from_numpy(g[k][t].astype(np.float32)) for k in FIELDS}
        s_next = {k: torch.from_numpy(g[k][t + 1].astype(np.float32)) for k in FIELDS}
        vel_in = s["velocity"]
        if self.noise > 0:
            n = torch.randn_like(vel_in) * self.noise
            n[node_type != 0] = 0
            vel_in = vel_in + n
        return {
            "node_type": node_type,
            "mesh_pos": torch.from_numpy(g["mesh_pos"][:].astype(np.float32)),
            "edges": triangles_to_edges(cells),
            "velocity": vel_in,
            "density": s["density"],
            "target_velocity": s_next["velocity"] - vel_in,
            "target_density": s_next["density"] - s["density"],
            "target_pressure": s_next["pressure"],
        }


class Normalizer(nn.Module):
    """Fixed mean/std, precomputed over the training set (tools/compute_stats.py)."""

    def __init__(self, mean, std, eps=1e-8):
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).clamp(min=eps))

    def forward(self, x):
        return (x - self.mean) / self.std

    def inverse(self, x):
        return x * self.std + self.mean


def load_stats(path):
    z = np.load(path)
    return {k[:-4]: (z[k[:-4] + "_mean"], z[k]) for k in z.files if k.endswith("_std")}


def mlp(din, dout, latent, ln=True):
    m = [nn.Linear(din, latent), nn.ReLU(), nn.Linear(latent, latent), nn.ReLU(), nn.Linear(latent, dout)]
    return nn.Sequential(*(m + [nn.LayerNorm(dout)] if ln else m))


class Processor(nn.Module):
    def __init__(self, latent):
        super().__init__()
        self.edge = mlp(3 * latent, latent, latent)
        self.node = mlp(2 * latent, latent, latent)

    def forward(self, h, e, ei):
        e2 = self.edge(torch.cat([e, h[ei[0]], h[ei[1]]], -1))
        agg = scatter_add(e2, ei[1], dim=0, dim_size=h.shape[0])
        return h + self.node(torch.cat([h, agg], -1)), e + e2


class AirfoilMGN(nn.Module):
    def __init__(self, latent, steps, stats):
        super().__init__()
        self.node_norm = Normalizer(*stats["node"])
        self.edge_norm = Normalizer(*stats["edge"])
        self.node_enc = mlp(3 + NODE_TYPES, latent, latent)
        self.edge_enc = mlp(3, latent, latent)
        self.proc = nn.ModuleList([Processor(latent) for _ in range(steps)])
        self.heads = nn.ModuleDict({k: mlp(latent, d, latent, ln=False) for k, d in FIELDS.items()})

    def forward(self, g):
        ei = g["edges"]
        rel = g["mesh_pos"][ei[0]] - g["mesh_pos"][ei[1]]
        ef = self.edge_norm(torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1))
        nf = torch.cat([self.node_norm(torch.cat([g["velocity"], g["density"]], -1)),
                        F.one_hot(g["node_type"], NODE_TYPES).float()], -1)
        h, e = self.node_enc(nf), self.edge_enc(ef)
        for blk in self.proc:
            h, e = blk(h, e, ei)
        return {k: head(h) for k, head in self.heads.items()}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dev = torch.device("cuda", lr_)
    torch.manual_seed(0)
    loss_fields = args.loss_fields.split(",")

    train = AirfoilSteps(os.path.join(args.data, "train.h5"), noise=args.noise)
    sampler = DistributedSampler(train, shuffle=True)
    loader = DataLoader(train, batch_size=None, sampler=sampler, num_workers=args.workers, pin_memory=True)

    stats = load_stats(os.path.join(args.data, "stats.npz"))
    net = AirfoilMGN(args.latent, args.message_passing, stats).to(dev)
    target_norms = nn.ModuleDict({k: Normalizer(*stats["target_" + k]) for k in FIELDS}).to(dev)
    model = DDP(net, device_ids=[lr_])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.1 ** (1 / (args.epochs * len(loader))))

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        meter = defaultdict(float)
        t0 = time.time()
        for g in loader:
            g = {k: v.to(dev, non_blocking=True) for k, v in g.items()}
            out = model(g)
            mask = (g["node_type"] == 0)
            loss = 0.0
            for k in loss_fields:
                tgt = target_norms[k](g["target_" + k])
                l_k = ((out[k] - tgt) ** 2).sum(-1)[mask].mean()
                meter[k] += l_k.item()
                loss = loss + l_k
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            meter["n"] += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"[{epoch}:{step}] loss {loss.item():.4e} " +
                      " ".join(f"{k}={meter[k] / meter['n']:.3e}" for k in loss_fields), flush=True)

        summary = torch.tensor([meter[k] for k in loss_fields] + [meter["n"]], device=dev)
        dist.all_reduce(summary)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s: " +
                  " ".join(f"{k}={summary[i].item() / summary[-1].item():.4e}" for i, k in enumerate(loss_fields)),
                  flush=True)
            torch.save({"model": model.module.state_dict(), "target_norms": target_norms.state_dict(),
                        "optimizer": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.save, f"epoch_{epoch:03d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
