"""GNS for granular column collapse (MPM data, CB-Geo), variable particle counts per run.

Trajectories are sharded by file across ranks, so ranks see different numbers of
windows per epoch; DDP's Join context takes care of the ranks that run out early.

    torchrun --nproc_per_node=8 18_gns_granular_column.py --data /work/mpm/column_collapse --out runs/column
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch_cluster import radius_graph
from torch_scatter import scatter_add

C = 6
N_TYPES = 9   # fixed by the dataset spec (3 = boundary, 6 = sand)
BOUNDARY = 3


def mlp(i, o, h=128, ln=True):
    layers = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*layers, *([nn.LayerNorm(o)] if ln else []))


class IN(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.phi_e, self.phi_v = mlp(3 * h, h), mlp(2 * h, h)

    def forward(self, v, e, ei):
        de = self.phi_e(torch.cat([v[ei[0]], v[ei[1]], e], -1))
        dv = self.phi_v(torch.cat([v, scatter_add(de, ei[1], 0, dim_size=v.shape[0])], -1))
        return v + dv, e + de


class GranularGNS(nn.Module):
    def __init__(self, dim, radius, bounds, h=128, n_mp=10):
        super().__init__()
        self.radius = radius
        self.register_buffer("bounds", torch.tensor(bounds, dtype=torch.float32))
        self.register_buffer("vel_mean", torch.zeros(dim))
        self.register_buffer("vel_std", torch.ones(dim))
        self.register_buffer("acc_mean", torch.zeros(dim))
        self.register_buffer("acc_std", torch.ones(dim))
        self.emb = nn.Embedding(N_TYPES, 16)
        self.enc_v = mlp((C - 1) * dim + 2 * dim + 16, h)
        self.enc_e = mlp(dim + 1, h)
        self.layers = nn.ModuleList(IN(h) for _ in range(n_mp))
        self.dec = mlp(h, dim, ln=False)

    def forward(self, seq, typ, batch):
        x = seq[:, -1]
        ei = radius_graph(x, self.radius, batch, loop=True, max_num_neighbors=128)
        vel = (seq[:, 1:] - seq[:, :-1] - self.vel_mean) / self.vel_std
        wall = (torch.cat([x - self.bounds[:, 0], self.bounds[:, 1] - x], -1) / self.radius).clamp(-1, 1)
        v = self.enc_v(torch.cat([vel.flatten(1), wall, self.emb(typ)], -1))
        d = (x[ei[0]] - x[ei[1]]) / self.radius
        e = self.enc_e(torch.cat([d, d.norm(dim=-1, keepdim=True)], -1))
        for layer in self.layers:
            v, e = layer(v, e, ei)
        return self.dec(v)


class Shard(Dataset):
    def __init__(self, files):
        self.traj = []
        for f in files:
            z = np.load(f)
            self.traj.append((z["positions"].astype(np.float32), z["particle_types"].astype(np.int64)))
        self.win = [(i, t) for i, (p, _) in enumerate(self.traj) for t in range(len(p) - C)]

    def __len__(self):
        return len(self.win)

    def __getitem__(self, k):
        i, t = self.win[k]
        p, ty = self.traj[i]
        return torch.from_numpy(np.ascontiguousarray(p[t:t + C + 1].swapaxes(0, 1))), torch.from_numpy(ty)


def collate(items):
    seq = torch.cat([s for s, _ in items])
    ty = torch.cat([t for _, t in items])
    b = torch.cat([torch.full((len(t),), j, dtype=torch.long) for j, (_, t) in enumerate(items)])
    return seq, ty, b


def set_global_stats(net, shard, noise_std, device):
    dim = net.vel_mean.numel()
    acc = torch.zeros(5, dim, dtype=torch.float64, device=device)  # sv, sv2, sa, sa2, [nv, na, ...]
    for p, _ in shard.traj:
        p = torch.from_numpy(p).to(device, torch.float64)
        v = (p[1:] - p[:-1]).reshape(-1, dim)
        a = (p[2:] - 2 * p[1:-1] + p[:-2]).reshape(-1, dim)
        acc[0] += v.sum(0); acc[1] += (v ** 2).sum(0)
        acc[2] += a.sum(0); acc[3] += (a ** 2).sum(0)
        acc[4, 0] += v.shape[0]; acc[4, 1] += a.shape[0]
    dist.all_reduce(acc)
    nv, na = acc[4, 0], acc[4, 1]
    vm, am = acc[0] / nv, acc[2] / na
    net.vel_mean.copy_(vm.float())
    net.vel_std.copy_(((acc[1] / nv - vm ** 2) + noise_std ** 2).sqrt().float())
    net.acc_mean.copy_(am.float())
    net.acc_std.copy_(((acc[3] / na - am ** 2) + noise_std ** 2).sqrt().float())


def random_walk_noise(seq, std):
    n = seq.shape[1] - 1
    vn = torch.cumsum(torch.randn_like(seq[:, 1:]) * (std / n ** 0.5), 1)
    return torch.cat([torch.zeros_like(vn[:, :1]), torch.cumsum(vn, 1)], 1)


@torch.no_grad()
def rollout_mse(net, path, device):
    z = np.load(path)
    p = torch.from_numpy(z["positions"].astype(np.float32)).to(device).transpose(0, 1)
    ty = torch.from_numpy(z["particle_types"].astype(np.int64)).to(device)
    b = torch.zeros_like(ty)
    cur, se = p[:, :C], []
    for s in range(C, p.shape[1]):
        a = net(cur, ty, b) * net.acc_std + net.acc_mean
        nxt = torch.where((ty == BOUNDARY).unsqueeze(-1), p[:, s], 2 * cur[:, -1] - cur[:, -2] + a)
        se.append(((nxt - p[:, s]) ** 2).mean().item())
        cur = torch.cat([cur[:, 1:], nxt[:, None]], 1)
    return float(np.mean(se))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--noise-std", type=float, default=6.7e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)  # independent noise per rank; DDP syncs the initial weights

    meta = json.load(open(os.path.join(args.data, "metadata.json")))
    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.npz")))
    valid_files = sorted(glob.glob(os.path.join(args.data, "valid", "*.npz")))
    shard = Shard(train_files[rank::world])

    net = GranularGNS(meta["dim"], meta["default_connectivity_radius"], meta["bounds"]).to(device)
    set_global_stats(net, shard, args.noise_std, device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        local = torch.zeros(2, device=device)
        with Join([model]):
            for seq, ty, b in loader:
                seq, ty, b = seq.to(device, non_blocking=True), ty.to(device), b.to(device)
                hist, nxt = seq[:, :-1], seq[:, -1]
                noise = random_walk_noise(hist, args.noise_std)
                noise[ty == BOUNDARY] = 0
                hist = hist + noise
                target = ((nxt + noise[:, -1]) - 2 * hist[:, -1] + hist[:, -2] - net.acc_mean) / net.acc_std
                pred = model(hist, ty, b)
                m = (ty != BOUNDARY).unsqueeze(-1).float()
                loss = (((pred - target) ** 2) * m).sum() / (m.sum() * pred.shape[-1])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                local += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(local)

        net.eval()
        mine = [rollout_mse(net, f, device) for f in valid_files[rank::world]]
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            allv = [v for part in gathered for v in part]
            print(f"epoch {epoch}: train {(local[0] / local[1]).item():.4e} over {int(local[1])} steps, "
                  f"rollout mse {np.mean(allv):.4e} on {len(allv)} trajectories, {time.time() - t0:.0f}s",
                  flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"gns_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
