"""GNS on BoxBath (rigid box falling into a water bath, DPI-Net data, 960 fluid + 64 rigid particles).

The raw data is a flat folder of 3000 rollouts (one .h5 per rollout); we hold out
10% of them for validation.

    torchrun --nproc_per_node=4 16_gns_boxbath.py --root /data/dpi/BoxBath --ckpt-dir ckpts/boxbath
"""
import argparse
import glob
import os
import random

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter_add

FLUID, RIGID = 0, 1
N_HIST = 5


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def mlp(i, o, h=128, ln=True):
    layers = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    if ln:
        layers.append(nn.LayerNorm(o))
    return nn.Sequential(*layers)


class Interaction(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fe, self.fn = mlp(3 * h, h), mlp(2 * h, h)

    def forward(self, x, e, ei):
        m = self.fe(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        return x + self.fn(torch.cat([x, scatter_add(m, ei[1], 0, dim_size=x.shape[0])], -1)), e + m


class BoxBathGNS(nn.Module):
    def __init__(self, radius, vel_stats, acc_stats, h=128, mp_steps=10):
        super().__init__()
        self.radius = radius
        self.register_buffer("v_mu", torch.tensor(vel_stats[0], dtype=torch.float32))
        self.register_buffer("v_sd", torch.tensor(vel_stats[1], dtype=torch.float32))
        self.register_buffer("a_mu", torch.tensor(acc_stats[0], dtype=torch.float32))
        self.register_buffer("a_sd", torch.tensor(acc_stats[1], dtype=torch.float32))
        self.type_emb = nn.Embedding(2, 16)
        self.enc_x = mlp(N_HIST * 3 + 16 + 1, h)
        self.enc_e = mlp(4 + 1, h)
        self.blocks = nn.ModuleList(Interaction(h) for _ in range(mp_steps))
        self.dec = mlp(h, 3, ln=False)

    def forward(self, pos, ptype, batch):
        cur = pos[:, -1]
        ei = radius_graph(cur, self.radius, batch, loop=False, max_num_neighbors=64)
        vel = (pos[:, 1:] - pos[:, :-1] - self.v_mu) / self.v_sd
        floor = (cur[:, 1:2] / self.radius).clamp(max=1.0)
        x = self.enc_x(torch.cat([vel.flatten(1), self.type_emb(ptype), floor], -1))
        d = (cur[ei[0]] - cur[ei[1]]) / self.radius
        same_body = ((ptype[ei[0]] == RIGID) & (ptype[ei[1]] == RIGID)).float().unsqueeze(-1)
        e = self.enc_e(torch.cat([d, d.norm(dim=-1, keepdim=True), same_body], -1))
        for blk in self.blocks:
            x, e = blk(x, e, ei)
        return self.dec(x)


class BoxBathWindows(Dataset):
    def __init__(self, files, noise_std=0.0):
        self.files = files
        self.noise_std = noise_std
        with h5py.File(files[0], "r") as f:
            self.T = f["positions"].shape[0]
            self.ptype = f["particle_type"][()].astype(np.int64)
        self.per_file = self.T - N_HIST - 1

    def __len__(self):
        return len(self.files) * self.per_file

    def __getitem__(self, k):
        fi, t = divmod(k, self.per_file)
        with h5py.File(self.files[fi], "r") as f:
            pos = f["positions"][t:t + N_HIST + 2].astype(np.float32)
        return torch.from_numpy(pos.transpose(1, 0, 2).copy()), torch.from_numpy(self.ptype)


def collate(items):
    pos = torch.cat([p for p, _ in items])
    typ = torch.cat([t for _, t in items])
    batch = torch.cat([torch.full((p.shape[0],), i, dtype=torch.long) for i, (p, _) in enumerate(items)])
    return pos, typ, batch


def estimate_stats(files, n=200):
    vs, accs = [], []
    for f in files[:n]:
        with h5py.File(f, "r") as h:
            p = h["positions"][()]
        v = np.diff(p, axis=0)
        vs.append(v.reshape(-1, 3))
        accs.append(np.diff(v, axis=0).reshape(-1, 3))
    v, a = np.concatenate(vs), np.concatenate(accs)
    return (v.mean(0), v.std(0)), (a.mean(0), a.std(0))


def history_noise(hist, std):
    k = hist.shape[1] - 1
    vn = torch.cumsum(torch.randn_like(hist[:, 1:]) * std / k ** 0.5, dim=1)
    return torch.cat([torch.zeros_like(vn[:, :1]), torch.cumsum(vn, dim=1)], dim=1)


def step_loss(model, net, pos, typ, batch, noise_std):
    hist, nxt = pos[:, :-1], pos[:, -1]
    noise = history_noise(hist, noise_std) if noise_std > 0 else torch.zeros_like(hist)
    hist = hist + noise
    target = ((nxt + noise[:, -1]) - 2 * hist[:, -1] + hist[:, -2] - net.a_mu) / net.a_sd
    return ((model(hist, typ, batch) - target) ** 2).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--radius", type=float, default=0.08)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--noise-std", type=float, default=3e-4)
    ap.add_argument("--valid-frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)  # different noise draws on each rank

    files = sorted(glob.glob(os.path.join(args.root, "*.h5")))
    random.shuffle(files)
    n_val = int(len(files) * args.valid_frac)
    val_files, train_files = files[:n_val], files[n_val:]

    vel_stats, acc_stats = estimate_stats(sorted(train_files))
    noisy = lambda s: (s[0], np.sqrt(s[1] ** 2 + args.noise_std ** 2))
    net = BoxBathGNS(args.radius, noisy(vel_stats), noisy(acc_stats)).to(device)
    dist.broadcast(net.v_mu, 0); dist.broadcast(net.v_sd, 0)
    dist.broadcast(net.a_mu, 0); dist.broadcast(net.a_sd, 0)
    model = DDP(net, device_ids=[local_rank])

    train_ds = BoxBathWindows(train_files)
    val_ds = BoxBathWindows(val_files)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, collate_fn=collate,
                            num_workers=4)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)  # tuned for 4 GPUs x 4 windows per step
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10, 20, 25], gamma=0.3)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best = float("inf")

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (pos, typ, batch) in enumerate(train_loader):
            pos, typ, batch = pos.to(device, non_blocking=True), typ.to(device), batch.to(device)
            loss = step_loss(model, net, pos, typ, batch, args.noise_std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 500 == 0:
                print(f"[{epoch}:{it}] loss {loss.item():.5f}", flush=True)
        sched.step()

        model.eval()
        s = torch.zeros(2, device=device)
        with torch.no_grad():
            for pos, typ, batch in val_loader:
                l = step_loss(net, net, pos.to(device), typ.to(device), batch.to(device), 0.0)
                s += torch.stack([l * pos.shape[0], torch.tensor(float(pos.shape[0]), device=device)])
        dist.all_reduce(s)
        val = (s[0] / s[1]).item()
        if rank == 0:
            print(f"epoch {epoch} validation one-step mse {val:.5e}", flush=True)
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "val": val,
                    "val_files": [os.path.basename(f) for f in val_files]}
            torch.save(ckpt, os.path.join(args.ckpt_dir, "last.pt"))
            if val < best:
                best = val
                torch.save(ckpt, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
