"""Mesh-based GNN surrogate for transient heat conduction (FEniCS runs on random 2D
domains with varying conductivity fields; 1.5k-12k nodes per mesh).

    torchrun --nproc_per_node=4 19_mgn_heat_mesh.py --data /data/heat2d --out runs/heat2d
"""
import argparse
import logging
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch_scatter import scatter_add

INTERIOR, DIRICHLET, NEUMANN = 0, 1, 2

log = logging.getLogger("heat")


@dataclass
class Config:
    data: str
    out: str
    hidden: int = 128
    mp_steps: int = 12
    batch_size: int = 4
    lr: float = 5e-4
    epochs: int = 60
    noise_std: float = 5e-3
    rollout_len: int = 100
    workers: int = 6


def mlp(i, o, h, ln=True):
    layers = [nn.Linear(i, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, o)]
    return nn.Sequential(*layers, nn.LayerNorm(o)) if ln else nn.Sequential(*layers)


class EdgeNodeBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_net = mlp(3 * h, h, h)
        self.node_net = mlp(2 * h, h, h)

    def forward(self, x, e, ei):
        e = e + self.edge_net(torch.cat([x[ei[0]], x[ei[1]], e], 1))
        x = x + self.node_net(torch.cat([x, scatter_add(e, ei[1], 0, dim_size=x.shape[0])], 1))
        return x, e


class HeatGNN(nn.Module):
    # node input: T, k (conductivity), q (source), one-hot boundary tag (3)
    def __init__(self, stats, hidden, steps):
        super().__init__()
        self.register_buffer("in_mean", torch.as_tensor(stats["in_mean"], dtype=torch.float32))
        self.register_buffer("in_std", torch.as_tensor(stats["in_std"], dtype=torch.float32))
        self.register_buffer("dT_mean", torch.as_tensor(stats["dT_mean"], dtype=torch.float32))
        self.register_buffer("dT_std", torch.as_tensor(stats["dT_std"], dtype=torch.float32))
        self.enc_x = mlp(6, hidden, hidden)
        self.enc_e = mlp(3, hidden, hidden)
        self.blocks = nn.ModuleList(EdgeNodeBlock(hidden) for _ in range(steps))
        self.dec = mlp(hidden, 1, hidden, ln=False)

    def forward(self, feats, edge_attr, ei):
        x = self.enc_x((feats - self.in_mean) / self.in_std)
        e = self.enc_e(edge_attr)
        for b in self.blocks:
            x, e = b(x, e, ei)
        return self.dec(x)


def node_features(T, k, q, tag):
    return torch.cat([T, k, q, nn.functional.one_hot(tag, 3).float()], 1)


def edge_features(pos, ei, length_scale):
    d = (pos[ei[0]] - pos[ei[1]]) / length_scale
    return torch.cat([d, d.norm(dim=1, keepdim=True)], 1)


class HeatSteps(Dataset):
    def __init__(self, root, split, noise_std):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))
        self.noise_std = noise_std
        self.steps = [np.load(f)["T"].shape[0] - 1 for f in self.files]
        self.items = [(i, t) for i, n in enumerate(self.steps) for t in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, j):
        i, t = self.items[j]
        z = np.load(self.files[i])
        tag = torch.from_numpy(z["tag"]).long()
        T0 = torch.from_numpy(z["T"][t]).float().unsqueeze(1)
        T1 = torch.from_numpy(z["T"][t + 1]).float().unsqueeze(1)
        if self.noise_std > 0:
            T0 = T0 + torch.randn_like(T0) * self.noise_std * (tag != DIRICHLET).float().unsqueeze(1)
        k = torch.from_numpy(z["k"]).float().unsqueeze(1)
        q = torch.from_numpy(z["q"]).float().unsqueeze(1)
        return (node_features(T0, k, q, tag), torch.from_numpy(z["pos"]).float(),
                torch.from_numpy(z["edges"]).long(), T1 - T0, tag, float(z["h"]))


def collate(batch):
    xs, ps, es, ys, tags, hs, off = [], [], [], [], [], [], 0
    for x, p, e, y, tag, h in batch:
        xs.append(x); ps.append(p); es.append(e + off); ys.append(y); tags.append(tag)
        hs.append(torch.full((x.shape[0], 1), h))
        off += x.shape[0]
    return torch.cat(xs), torch.cat(ps), torch.cat(es, 1), torch.cat(ys), torch.cat(tags), torch.cat(hs)


@torch.no_grad()
def rollout(net, path, device, n):
    z = np.load(path)
    tag = torch.from_numpy(z["tag"]).long().to(device)
    pos = torch.from_numpy(z["pos"]).float().to(device)
    ei = torch.from_numpy(z["edges"]).long().to(device)
    k = torch.from_numpy(z["k"]).float().unsqueeze(1).to(device)
    q = torch.from_numpy(z["q"]).float().unsqueeze(1).to(device)
    gt = torch.from_numpy(z["T"]).float().unsqueeze(-1).to(device)
    ea = edge_features(pos, ei, float(z["h"]))
    T, errs = gt[0], []
    for t in range(min(n, gt.shape[0] - 1)):
        dT = net(node_features(T, k, q, tag), ea, ei) * net.dT_std + net.dT_mean
        T = torch.where((tag == DIRICHLET).unsqueeze(1), gt[t + 1], T + dT)
        errs.append(((T - gt[t + 1]) ** 2).mean().sqrt().item())
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    a = ap.parse_args()
    cfg = Config(data=a.data, out=a.out, epochs=a.epochs, batch_size=a.batch_size)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    log.info("config: %s", asdict(cfg))

    stats = np.load(os.path.join(cfg.data, "train_stats.npz"))
    net = HeatGNN(stats, cfg.hidden, cfg.mp_steps).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-6)  # lr tuned for 4 GPUs x 4 graphs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs, eta_min=cfg.lr * 0.01)

    train = HeatSteps(cfg.data, "train", cfg.noise_std)
    loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=True, collate_fn=collate,
                        num_workers=cfg.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_files = sorted(os.path.join(cfg.data, "valid", f) for f in os.listdir(os.path.join(cfg.data, "valid")))
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    for epoch in range(cfg.epochs):
        model.train()
        t0 = time.time()
        stats_t = torch.zeros(2, device=device)
        for x, pos, ei, y, tag, h in loader:
            x, pos, ei, y, tag, h = (v.to(device, non_blocking=True) for v in (x, pos, ei, y, tag, h))
            ea = edge_features(pos, ei, h[ei[0]])
            pred = model(x, ea, ei)
            yn = (y - net.dT_mean) / net.dT_std
            m = tag != DIRICHLET
            loss = ((pred - yn) ** 2)[m].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats_t += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats_t)
        log.info("epoch %d train loss %.4e (%.0fs)", epoch, (stats_t[0] / stats_t[1]).item(), time.time() - t0)

        if rank == 0 and epoch % 5 == 4:
            net.eval()
            errs = np.array([rollout(net, f, device, cfg.rollout_len) for f in val_files[:10]])
            log.info("epoch %d rollout rmse: step1 %.3e  step%d %.3e  mean %.3e", epoch, errs[:, 0].mean(),
                     errs.shape[1], errs[:, -1].mean(), errs.mean())
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "config": asdict(cfg)}, os.path.join(cfg.out, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
