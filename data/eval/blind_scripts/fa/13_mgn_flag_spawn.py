"""MeshGraphNets, flag_simple, single workstation with several GPUs.

Processes are started with torch.multiprocessing.spawn so the script can be run
directly:

    python 13_mgn_flag_spawn.py --data /data/flag_simple --gpus 4 --out runs/flag
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_scatter import scatter_add

NORMAL, HANDLE = 0, 3
NUM_TYPES = 9


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def mlp(i, o, h=128, ln=True):
    layers = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*(layers + [nn.LayerNorm(o)] if ln else layers))


class GraphNetBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge_fn, self.node_fn = mlp(3 * h, h), mlp(2 * h, h)

    def forward(self, x, e, ei):
        e2 = self.edge_fn(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        x2 = self.node_fn(torch.cat([x, scatter_add(e2, ei[1], 0, dim_size=x.shape[0])], -1))
        return x + x2, e + e2


class FlagNet(nn.Module):
    def __init__(self, h=128, n_mp=15):
        super().__init__()
        self.register_buffer("x_mean", torch.zeros(3 + NUM_TYPES))
        self.register_buffer("x_std", torch.ones(3 + NUM_TYPES))
        self.register_buffer("e_mean", torch.zeros(7))
        self.register_buffer("e_std", torch.ones(7))
        self.register_buffer("y_mean", torch.zeros(3))
        self.register_buffer("y_std", torch.ones(3))
        self.enc_x, self.enc_e = mlp(3 + NUM_TYPES, h), mlp(7, h)
        self.blocks = nn.ModuleList(GraphNetBlock(h) for _ in range(n_mp))
        self.dec = mlp(h, 3, ln=False)

    def forward(self, x, e, ei):
        x = self.enc_x((x - self.x_mean) / self.x_std)
        e = self.enc_e((e - self.e_mean) / self.e_std)
        for b in self.blocks:
            x, e = b(x, e, ei)
        return self.dec(x)


def features(wp, prev, mesh_pos, nt, ei):
    x = torch.cat([wp - prev, F.one_hot(nt, NUM_TYPES).float()], -1)
    dw, dm = wp[ei[0]] - wp[ei[1]], mesh_pos[ei[0]] - mesh_pos[ei[1]]
    e = torch.cat([dw, dw.norm(dim=-1, keepdim=True), dm, dm.norm(dim=-1, keepdim=True)], -1)
    return x, e


def load_traj(path):
    d = np.load(path)
    return {k: torch.from_numpy(d[k]) for k in ("world_pos", "mesh_pos", "node_type", "edges")}


class FlagSteps(Dataset):
    def __init__(self, files, noise_std=0.003, gamma=0.1):
        self.files, self.noise_std, self.gamma = files, noise_std, gamma
        self.T = np.load(files[0])["world_pos"].shape[0] - 2

    def __len__(self):
        return len(self.files) * self.T

    def __getitem__(self, k):
        tr = load_traj(self.files[k // self.T])
        t = k % self.T + 1
        wp = tr["world_pos"].float()
        nt = tr["node_type"].long().view(-1)
        prev, cur, nxt = wp[t - 1], wp[t].clone(), wp[t + 1].clone()
        if self.noise_std > 0:
            n = torch.randn_like(cur) * self.noise_std
            n[nt != NORMAL] = 0
            cur += n
            nxt += (1 - self.gamma) * n
        return cur, prev, nxt, tr["mesh_pos"].float(), nt, tr["edges"].long()


def collate(batch):
    out, off = [[] for _ in range(6)], 0
    for item in batch:
        for j, v in enumerate(item):
            out[j].append(v + off if j == 5 else v)
        off += item[0].shape[0]
    return [torch.cat(o, dim=1 if j == 5 else 0) for j, o in enumerate(out)]


def dataset_statistics(files, rank, world, cpu_group):
    """Per-feature mean/std over all training steps; each rank scans a slice of the files."""
    s = {k: torch.zeros(2, n, dtype=torch.float64) for k, n in (("x", 3 + NUM_TYPES), ("e", 7), ("y", 3))}
    cnt = torch.zeros(3, dtype=torch.float64)
    for path in files[rank::world]:
        tr = load_traj(path)
        wp, nt = tr["world_pos"].double(), tr["node_type"].long().view(-1)
        for t in range(1, wp.shape[0] - 1):
            x, e = features(wp[t], wp[t - 1], tr["mesh_pos"].double(), nt, tr["edges"].long())
            y = wp[t + 1] - 2 * wp[t] + wp[t - 1]
            for j, (k, v) in enumerate((("x", x.double()), ("e", e), ("y", y))):
                s[k][0] += v.sum(0)
                s[k][1] += (v ** 2).sum(0)
                cnt[j] += v.shape[0]
    for k in s:
        dist.all_reduce(s[k], group=cpu_group)
    dist.all_reduce(cnt, group=cpu_group)
    out = {}
    for j, k in enumerate(s):
        mean = s[k][0] / cnt[j]
        out[k] = (mean.float(), (s[k][1] / cnt[j] - mean ** 2).clamp(min=1e-12).sqrt().float())
    return out


@torch.no_grad()
def rollout_mse(net, path, device, steps=400):
    tr = load_traj(path)
    wp = tr["world_pos"].float().to(device)
    nt = tr["node_type"].long().view(-1).to(device)
    mp_, ei = tr["mesh_pos"].float().to(device), tr["edges"].long().to(device)
    prev, cur = wp[0], wp[1]
    pinned = (nt == HANDLE).unsqueeze(-1)
    err = []
    for t in range(1, min(steps, wp.shape[0] - 1)):
        x, e = features(cur, prev, mp_, nt, ei)
        acc = net(x, e, ei) * net.y_std + net.y_mean
        nxt = torch.where(pinned, wp[t + 1], 2 * cur - prev + acc)
        err.append(((nxt - wp[t + 1]) ** 2).sum(-1).mean().item())
        prev, cur = cur, nxt
    return float(np.mean(err))


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    cpu_group = dist.new_group(backend="gloo")
    device = torch.device("cuda", rank)

    files = sorted(os.path.join(args.data, "train", f) for f in os.listdir(os.path.join(args.data, "train")))
    stats = dataset_statistics(files, rank, world_size, cpu_group)

    net = FlagNet()
    for k, (m, sd) in stats.items():
        getattr(net, f"{k}_mean").copy_(m)
        getattr(net, f"{k}_std").copy_(sd)
    net = net.to(device)
    # statistics are identical on every rank and never change; no need to broadcast buffers
    model = DDP(net, device_ids=[rank], broadcast_buffers=False)

    ds = FlagSteps(files, noise_std=args.noise_std)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, multiprocessing_context="spawn")
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)  # --lr is per GPU (batch 1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.1 ** (1 / args.epochs))

    valid = sorted(os.path.join(args.data, "valid", f) for f in os.listdir(os.path.join(args.data, "valid")))
    ckpt_path = os.path.join(args.out, "flag.pt")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, loss_acc = time.time(), torch.zeros(2, device=device)
        for cur, prev, nxt, mesh_pos, nt, ei in loader:
            cur, prev, nxt = cur.to(device), prev.to(device), nxt.to(device)
            mesh_pos, nt, ei = mesh_pos.to(device), nt.to(device), ei.to(device)
            x, e = features(cur, prev, mesh_pos, nt, ei)
            y = (nxt - 2 * cur + prev - net.y_mean) / net.y_std
            pred = model(x, e, ei)
            loss = ((pred - y) ** 2).sum(-1)[nt == NORMAL].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(loss_acc)

        if rank == 0:
            net.eval()
            val = np.mean([rollout_mse(net, f, device) for f in valid[:args.n_valid]])
            print(f"epoch {epoch}: loss {(loss_acc[0] / loss_acc[1]).item():.4e}  rollout mse {val:.4e}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/flag")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--noise-std", type=float, default=0.003)
    ap.add_argument("--n-valid", type=int, default=5)
    args = ap.parse_args()
    args.port = free_port()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
