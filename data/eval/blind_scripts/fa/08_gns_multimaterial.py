"""GNS for the MultiMaterial dataset (water / sand / goop interacting with rigid obstacles).

The training set is ~1000 trajectories stored one per file; every rank loads only
its own shard of files into memory and samples windows from it.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        08_gns_multimaterial.py --data-dir /lustre/gns/MultiMaterial --out /lustre/gns/runs/mm
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, RandomSampler
from torch_cluster import radius_graph
from torch_scatter import scatter_add

INPUT_LEN = 6
KINEMATIC = 3


def mlp(i, o, h=128, ln=True):
    layers = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*layers, nn.LayerNorm(o)) if ln else nn.Sequential(*layers)


class InteractionBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.edge = mlp(3 * h, h)
        self.node = mlp(2 * h, h)

    def forward(self, x, e, ei):
        m = self.edge(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        x = x + self.node(torch.cat([x, scatter_add(m, ei[1], 0, dim_size=x.shape[0])], -1))
        return x, e + m


class MaterialGNS(nn.Module):
    def __init__(self, n_types, dim, radius, bounds, latent=128, n_mp=10, emb_dim=16):
        super().__init__()
        self.radius = radius
        self.register_buffer("bounds", torch.tensor(bounds, dtype=torch.float32))
        self.register_buffer("vel_mean", torch.zeros(dim))
        self.register_buffer("vel_std", torch.ones(dim))
        self.register_buffer("acc_mean", torch.zeros(dim))
        self.register_buffer("acc_std", torch.ones(dim))
        self.material = nn.Embedding(n_types, emb_dim)
        self.enc_x = mlp((INPUT_LEN - 1) * dim + 2 * dim + emb_dim, latent)
        self.enc_e = mlp(dim + 1, latent)
        self.blocks = nn.ModuleList([InteractionBlock(latent) for _ in range(n_mp)])
        self.dec = mlp(latent, dim, ln=False)

    def forward(self, seq, ptype, batch):
        last = seq[:, -1]
        ei = radius_graph(last, r=self.radius, batch=batch, loop=True, max_num_neighbors=64)
        vel = (seq[:, 1:] - seq[:, :-1] - self.vel_mean) / self.vel_std
        wall = torch.cat([last - self.bounds[:, 0], self.bounds[:, 1] - last], -1) / self.radius
        x = self.enc_x(torch.cat([vel.flatten(1), wall.clamp(-1, 1), self.material(ptype)], -1))
        rel = (last[ei[0]] - last[ei[1]]) / self.radius
        e = self.enc_e(torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1))
        for b in self.blocks:
            x, e = b(x, e, ei)
        return self.dec(x)


class ShardWindows(Dataset):
    def __init__(self, files):
        self.traj = []
        for f in files:
            z = np.load(f)
            self.traj.append((z["position"].astype(np.float32), z["particle_type"].astype(np.int64)))
        self.windows = [(i, t) for i, (p, _) in enumerate(self.traj) for t in range(p.shape[0] - INPUT_LEN)]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, k):
        i, t = self.windows[k]
        p, ty = self.traj[i]
        return torch.from_numpy(p[t:t + INPUT_LEN + 1].swapaxes(0, 1).copy()), torch.from_numpy(ty)


def collate(items):
    seq = torch.cat([a for a, _ in items])
    ty = torch.cat([b for _, b in items])
    batch = torch.cat([torch.full((a.shape[0],), j, dtype=torch.long) for j, (a, _) in enumerate(items)])
    return seq, ty, batch


@torch.no_grad()
def global_stats(ds, noise_std, device):
    """Velocity / acceleration statistics over the whole training set (all shards)."""
    s = torch.zeros(4, ds.traj[0][0].shape[-1], dtype=torch.float64, device=device)
    n = torch.zeros(2, dtype=torch.float64, device=device)
    for p, _ in ds.traj:
        p = torch.from_numpy(p).to(device).double()
        v = p[1:] - p[:-1]
        a = v[1:] - v[:-1]
        v, a = v.reshape(-1, v.shape[-1]), a.reshape(-1, a.shape[-1])
        s[0] += v.sum(0); s[1] += (v ** 2).sum(0)
        s[2] += a.sum(0); s[3] += (a ** 2).sum(0)
        n[0] += v.shape[0]; n[1] += a.shape[0]
    dist.all_reduce(s)
    dist.all_reduce(n)
    vm, am = s[0] / n[0], s[2] / n[1]
    vs = (s[1] / n[0] - vm ** 2).sqrt()
    as_ = (s[3] / n[1] - am ** 2).sqrt()
    noisy = lambda sd: torch.sqrt(sd ** 2 + noise_std ** 2)
    return vm.float(), noisy(vs).float(), am.float(), noisy(as_).float()


@torch.no_grad()
def rollout_mse(net, path, device, max_steps=300):
    z = np.load(path)
    p = torch.from_numpy(z["position"].astype(np.float32)).to(device).transpose(0, 1)
    ty = torch.from_numpy(z["particle_type"].astype(np.int64)).to(device)
    b = torch.zeros_like(ty)
    cur = p[:, :INPUT_LEN]
    kin = (ty == KINEMATIC).unsqueeze(-1)
    errs = []
    for s in range(INPUT_LEN, min(p.shape[1], INPUT_LEN + max_steps)):
        acc = net(cur, ty, b) * net.acc_std + net.acc_mean
        nxt = torch.where(kin, p[:, s], 2 * cur[:, -1] - cur[:, -2] + acc)
        errs.append(((nxt - p[:, s]) ** 2).mean())
        cur = torch.cat([cur[:, 1:], nxt[:, None]], 1)
    return torch.stack(errs).mean().item()


def rw_noise(seq, std):
    k = seq.shape[1] - 1
    vn = torch.cumsum(torch.randn_like(seq[:, 1:]) * (std / k ** 0.5), 1)
    return torch.cat([torch.zeros_like(vn[:, :1]), torch.cumsum(vn, 1)], 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps-per-epoch", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--noise-std", type=float, default=6.7e-4)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--n-eval", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17 + rank)

    with open(os.path.join(args.data_dir, "metadata.json")) as f:
        meta = json.load(f)
    files = sorted(glob.glob(os.path.join(args.data_dir, "train", "*.npz")))
    shard = ShardWindows(files[rank::world])
    n_types = int(max(t.max() for _, t in shard.traj)) + 1

    net = MaterialGNS(n_types, meta["dim"], meta["default_connectivity_radius"], meta["bounds"]).to(device)
    vm, vs, am, as_ = global_stats(shard, args.noise_std, device)
    net.vel_mean.copy_(vm); net.vel_std.copy_(vs)
    net.acc_mean.copy_(am); net.acc_std.copy_(as_)
    model = DDP(net, device_ids=[local_rank])

    # each rank draws the same number of windows per epoch from its own shard
    sampler = RandomSampler(shard, replacement=True, num_samples=args.steps_per_epoch * args.batch_size)
    loader = DataLoader(shard, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.steps_per_epoch,
                                                       eta_min=1e-6)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for seq, ty, batch in loader:
            seq, ty, batch = seq.to(device, non_blocking=True), ty.to(device), batch.to(device)
            inp, nxt = seq[:, :-1], seq[:, -1]
            noise = rw_noise(inp, args.noise_std)
            noise[ty == KINEMATIC] = 0
            inp = inp + noise
            target = ((nxt + noise[:, -1]) - 2 * inp[:, -1] + inp[:, -2] - net.acc_mean) / net.acc_std
            pred = model(inp, ty, batch)
            free = (ty != KINEMATIC).unsqueeze(-1).float()
            loss = (((pred - target) ** 2) * free).sum() / (free.sum() * pred.shape[-1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch:4d}  loss {tot[0].item() / tot[1].item():.5f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % args.eval_every == 0:
                net.eval()
                valid = sorted(glob.glob(os.path.join(args.data_dir, "valid", "*.npz")))[:args.n_eval]
                mse = np.mean([rollout_mse(net, f, device) for f in valid])
                print(f"epoch {epoch:4d}  valid rollout mse {mse:.4e}", flush=True)
            torch.save({"model": net.state_dict(), "n_types": n_types, "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "latest.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
