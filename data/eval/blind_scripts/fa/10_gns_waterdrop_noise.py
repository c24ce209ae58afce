"""
GNS on WaterDrop-XL with recomputed normalisation statistics.

The published metadata.json statistics are for the small WaterDrop set, so the
velocity / acceleration statistics are recomputed over the training
trajectories (split over ranks, then summed) before training starts.

    torchrun --nproc_per_node=8 10_gns_waterdrop_noise.py --data /data/WaterDropXL --noise-std 3e-4
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torch_cluster import radius_graph
from torch_scatter import scatter_sum

HIST = 6
STATIC = 3


def ffn(i, o, h=128, ln=True):
    mods = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    if ln:
        mods.append(nn.LayerNorm(o))
    return nn.Sequential(*mods)


class GN(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fe, self.fv = ffn(3 * h, h), ffn(2 * h, h)

    def forward(self, v, e, ei):
        e_new = self.fe(torch.cat([v[ei[0]], v[ei[1]], e], -1))
        v_new = self.fv(torch.cat([v, scatter_sum(e_new, ei[1], 0, dim_size=v.shape[0])], -1))
        return v + v_new, e + e_new


class Simulator(nn.Module):
    def __init__(self, dim, radius, bounds, latent=128, mp=10):
        super().__init__()
        self.radius = radius
        self.register_buffer("bounds", torch.tensor(bounds, dtype=torch.float32))
        for name in ("vel_mean", "vel_std", "acc_mean", "acc_std"):
            self.register_buffer(name, torch.zeros(dim) if "mean" in name else torch.ones(dim))
        self.type_emb = nn.Embedding(9, 16)
        self.enc_v = ffn((HIST - 1) * dim + 2 * dim + 16, latent)
        self.enc_e = ffn(dim + 1, latent)
        self.gn = nn.ModuleList(GN(latent) for _ in range(mp))
        self.dec = ffn(latent, dim, ln=False)

    def forward(self, pos, ptype, batch):
        p = pos[:, -1]
        ei = radius_graph(p, self.radius, batch, loop=True, max_num_neighbors=128)
        vel = (pos[:, 1:] - pos[:, :-1] - self.vel_mean) / self.vel_std
        bd = torch.cat([p - self.bounds[:, 0], self.bounds[:, 1] - p], -1) / self.radius
        v = self.enc_v(torch.cat([vel.flatten(1), bd.clamp(-1, 1), self.type_emb(ptype)], -1))
        d = (p[ei[0]] - p[ei[1]]) / self.radius
        e = self.enc_e(torch.cat([d, d.norm(dim=-1, keepdim=True)], -1))
        for layer in self.gn:
            v, e = layer(v, e, ei)
        return self.dec(v)

    @torch.no_grad()
    def step(self, pos, ptype, batch):
        acc = self(pos, ptype, batch) * self.acc_std + self.acc_mean
        return 2 * pos[:, -1] - pos[:, -2] + acc


class WaterDrop(Dataset):
    def __init__(self, path):
        raw = np.load(path, allow_pickle=True)["gns_data"]
        self.traj = [(np.asarray(p, np.float32), np.asarray(t, np.int64)) for p, t in raw]
        self.idx = [(i, s) for i, (p, _) in enumerate(self.traj) for s in range(p.shape[0] - HIST)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i, s = self.idx[k]
        p, t = self.traj[i]
        return torch.from_numpy(np.ascontiguousarray(p[s:s + HIST + 1].transpose(1, 0, 2))), torch.from_numpy(t)


def collate(samples):
    pos = torch.cat([s[0] for s in samples])
    typ = torch.cat([s[1] for s in samples])
    bat = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor([s[0].shape[0] for s in samples]))
    return pos, typ, bat


def accumulate_statistics(ds, rank, world):
    """Sum and squared sum of finite-difference velocities / accelerations over this rank's trajectories."""
    dim = ds.traj[0][0].shape[-1]
    sums = torch.zeros(4, dim, dtype=torch.float64)
    counts = torch.zeros(2, dtype=torch.float64)
    for p, _ in ds.traj[rank::world]:
        v = np.diff(p, axis=0).reshape(-1, dim)
        a = np.diff(p, n=2, axis=0).reshape(-1, dim)
        sums[0] += torch.from_numpy(v.sum(0)).double()
        sums[1] += torch.from_numpy((v.astype(np.float64) ** 2).sum(0))
        sums[2] += torch.from_numpy(a.sum(0)).double()
        sums[3] += torch.from_numpy((a.astype(np.float64) ** 2).sum(0))
        counts[0] += v.shape[0]
        counts[1] += a.shape[0]
    dist.all_reduce(sums)
    dist.all_reduce(counts)
    vel_mean, acc_mean = sums[0] / counts[0], sums[2] / counts[1]
    vel_std = torch.sqrt(sums[1] / counts[0] - vel_mean ** 2)
    acc_std = torch.sqrt(sums[3] / counts[1] - acc_mean ** 2)
    return vel_mean.float(), vel_std.float(), acc_mean.float(), acc_std.float()


def make_noise(pos, std):
    n = pos.shape[1] - 1
    v = torch.cumsum(torch.randn_like(pos[:, 1:]) * (std / math.sqrt(n)), dim=1)
    return torch.cat([torch.zeros_like(v[:, :1]), torch.cumsum(v, dim=1)], dim=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/waterdrop_xl")
    ap.add_argument("--noise-std", type=float, default=3e-4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--rollout-every", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    meta = json.load(open(os.path.join(args.data, "metadata.json")))
    train = WaterDrop(os.path.join(args.data, "train.npz"))
    vm, vs, am, as_ = accumulate_statistics(train, rank, world)

    sim = Simulator(meta["dim"], meta["default_connectivity_radius"], meta["bounds"])
    sim.vel_mean.copy_(vm)
    sim.vel_std.copy_(torch.sqrt(vs ** 2 + args.noise_std ** 2))
    sim.acc_mean.copy_(am)
    sim.acc_std.copy_(torch.sqrt(as_ ** 2 + args.noise_std ** 2))
    sim = sim.to(device)
    model = DDP(sim, device_ids=[local_rank], output_device=local_rank)

    sampler = DistributedSampler(train, shuffle=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.01, 0.1 ** (s / total)))

    writer = SummaryWriter(args.out) if rank == 0 else None
    valid = np.load(os.path.join(args.data, "valid.npz"), allow_pickle=True)["gns_data"]

    gstep = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for pos, typ, bat in loader:
            pos, typ, bat = pos.to(device, non_blocking=True), typ.to(device), bat.to(device)
            hist, nxt = pos[:, :-1], pos[:, -1]
            noise = make_noise(hist, args.noise_std)
            noise[typ == STATIC] = 0.0
            hist = hist + noise
            acc_t = (nxt + noise[:, -1]) - 2 * hist[:, -1] + hist[:, -2]
            acc_t = (acc_t - sim.acc_mean) / sim.acc_std
            pred = model(hist, typ, bat)
            m = (typ != STATIC).unsqueeze(-1).float()
            loss = ((pred - acc_t) ** 2 * m).sum() / (m.sum() * pred.shape[-1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            gstep += 1
            if writer is not None and gstep % 100 == 0:
                writer.add_scalar("loss/train", loss.item(), gstep)
                writer.add_scalar("lr", sched.get_last_lr()[0], gstep)

        if rank == 0 and (epoch + 1) % args.rollout_every == 0:
            sim.eval()
            errs = []
            for p, t in valid[:8]:
                p = torch.from_numpy(np.asarray(p, np.float32).transpose(1, 0, 2)).to(device)
                t = torch.from_numpy(np.asarray(t, np.int64)).to(device)
                b = torch.zeros_like(t)
                cur = p[:, :HIST]
                for s in range(HIST, p.shape[1]):
                    nxt = torch.where((t == STATIC).unsqueeze(-1), p[:, s], sim.step(cur, t, b))
                    cur = torch.cat([cur[:, 1:], nxt[:, None]], 1)
                    errs.append(((nxt - p[:, s]) ** 2).mean().item())
            writer.add_scalar("rollout/mse", float(np.mean(errs)), epoch)
            print(f"epoch {epoch}: rollout mse {np.mean(errs):.4e}, {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": sim.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": gstep}, os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
