"""GNS surrogate for our SPH dam-break / sloshing runs (DualSPHysics output converted to HDF5).

Particle counts differ between runs (resolution sweep 8k-60k particles).

    torchrun --nproc_per_node=4 14_gns_sph_dambreak.py config/sph_dambreak.yaml
    torchrun --nproc_per_node=4 14_gns_sph_dambreak.py config/sph_dambreak.yaml resume=runs/dam/ckpt_0040.pt
"""
import glob
import math
import os
import sys
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter

WALL = 1  # DualSPHysics boundary particles
HIST = 5

DEFAULTS = OmegaConf.create({
    "data_dir": "/data/sph/dambreak_h5",
    "run_dir": "runs/dam",
    "radius": 0.015,
    "latent": 128,
    "mp_steps": 10,
    "batch_size": 2,
    "lr": 1e-4,
    "min_lr": 1e-6,
    "epochs": 60,
    "noise_std": 5e-4,
    "save_every": 5,
    "workers": 6,
    "resume": None,
})


def MLP(i, o, h, ln=True):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o),
                         nn.LayerNorm(o) if ln else nn.Identity())


class Processor(nn.Module):
    def __init__(self, h, steps):
        super().__init__()
        self.edge = nn.ModuleList([MLP(3 * h, h, h) for _ in range(steps)])
        self.node = nn.ModuleList([MLP(2 * h, h, h) for _ in range(steps)])

    def forward(self, v, e, ei):
        for fe, fv in zip(self.edge, self.node):
            m = fe(torch.cat([v[ei[0]], v[ei[1]], e], -1))
            v = v + fv(torch.cat([v, scatter(m, ei[1], 0, dim_size=v.size(0), reduce="sum")], -1))
            e = e + m
        return v


class SPHNet(nn.Module):
    def __init__(self, cfg, stats):
        super().__init__()
        self.r = cfg.radius
        for k, v in stats.items():
            self.register_buffer(k, torch.as_tensor(v, dtype=torch.float32))
        self.enc_v = MLP(HIST * 3 + 1 + 2, cfg.latent, cfg.latent)  # velocities, wall flag, height & depth
        self.enc_e = MLP(4, cfg.latent, cfg.latent)
        self.proc = Processor(cfg.latent, cfg.mp_steps)
        self.dec = MLP(cfg.latent, 3, cfg.latent, ln=False)

    def forward(self, pos, is_wall, batch):
        cur = pos[:, -1]
        ei = radius_graph(cur, self.r, batch, loop=False, max_num_neighbors=64)
        vel = (pos[:, 1:] - pos[:, :-1] - self.vel_mean) / self.vel_std
        z = cur[:, 2:3]
        v = torch.cat([vel.flatten(1), is_wall.float().unsqueeze(-1), z, (self.z_top - z)], -1)
        d = (cur[ei[0]] - cur[ei[1]]) / self.r
        e = torch.cat([d, d.norm(dim=-1, keepdim=True)], -1)
        return self.dec(self.proc(self.enc_v(v), self.enc_e(e), ei))


class SPHWindows(Dataset):
    def __init__(self, files):
        self.files = files
        self.lengths = []
        for f in files:
            with h5py.File(f, "r") as h:
                self.lengths.append(h["pos"].shape[0] - HIST - 1)
        self.cum = np.cumsum([0] + self.lengths)
        self.handles = {}

    def __len__(self):
        return int(self.cum[-1])

    def _h(self, i):
        if i not in self.handles:
            self.handles[i] = h5py.File(self.files[i], "r")
        return self.handles[i]

    def __getitem__(self, k):
        i = int(np.searchsorted(self.cum, k, side="right") - 1)
        t = int(k - self.cum[i])
        h = self._h(i)
        pos = torch.from_numpy(h["pos"][t:t + HIST + 2]).float().transpose(0, 1)
        wall = torch.from_numpy(h["ptype"][()] == WALL)
        return pos, wall


def collate(batch):
    pos = torch.cat([b[0] for b in batch])
    wall = torch.cat([b[1] for b in batch])
    idx = torch.cat([torch.full((b[0].shape[0],), i, dtype=torch.long) for i, b in enumerate(batch)])
    return pos, wall, idx


def load_stats(data_dir):
    z = np.load(os.path.join(data_dir, "normalization.npz"))
    return {k: z[k] for k in ("vel_mean", "vel_std", "acc_mean", "acc_std", "z_top")}


def noise_for(pos, std):
    n_v = pos.shape[1] - 1
    dv = torch.randn_like(pos[:, 1:]) * (std / math.sqrt(n_v))
    vn = dv.cumsum(1)
    return torch.cat([torch.zeros_like(vn[:, :1]), vn.cumsum(1)], 1)


def compute_loss(model, net, pos, wall, batch, noise_std):
    hist, target = pos[:, :-1], pos[:, -1]
    noise = noise_for(hist, noise_std)
    noise[wall] = 0
    hist = hist + noise
    acc = (target + noise[:, -1]) - 2 * hist[:, -1] + hist[:, -2]
    acc = (acc - net.acc_mean) / torch.sqrt(net.acc_std ** 2 + noise_std ** 2)
    pred = model(hist, wall, batch)
    fluid = ~wall
    return ((pred[fluid] - acc[fluid]) ** 2).mean()


def main():
    cfg = OmegaConf.merge(DEFAULTS, OmegaConf.load(sys.argv[1]), OmegaConf.from_cli(sys.argv[2:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(cfg.data_dir, "train", "*.h5")))
    vfiles = sorted(glob.glob(os.path.join(cfg.data_dir, "valid", "*.h5")))
    stats = load_stats(cfg.data_dir)
    net = SPHNet(cfg, stats).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs, eta_min=cfg.min_lr)

    start_epoch = 0
    if cfg.resume:
        ckpt = torch.load(cfg.resume)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed {cfg.resume} (epoch {ckpt['epoch']})", flush=True)

    train = SPHWindows(files)
    valid = SPHWindows(vfiles)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    vsampler = DistributedSampler(valid, shuffle=False)
    loader = DataLoader(train, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        collate_fn=collate, pin_memory=True, persistent_workers=True)
    vloader = DataLoader(valid, batch_size=cfg.batch_size, sampler=vsampler, num_workers=2, collate_fn=collate)

    if rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.run_dir, "config.yaml"))

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (pos, wall, batch) in enumerate(loader):
            pos, wall, batch = pos.to(device, non_blocking=True), wall.to(device), batch.to(device)
            loss = compute_loss(model, net, pos, wall, batch, cfg.noise_std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and it % 250 == 0:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.5f}", flush=True)
        sched.step()

        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for pos, wall, batch in vloader:
                pos, wall, batch = pos.to(device), wall.to(device), batch.to(device)
                acc[0] += compute_loss(net, net, pos, wall, batch, 0.0) * pos.shape[0]
                acc[1] += pos.shape[0]
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} val {(acc[0] / acc[1]).item():.5f} time {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % cfg.save_every == 0 or epoch + 1 == cfg.epochs:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "epoch": epoch},
                           os.path.join(cfg.run_dir, f"ckpt_{epoch + 1:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
