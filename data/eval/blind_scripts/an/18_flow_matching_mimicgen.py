"""Conditional flow-matching policy (rectified flow over action chunks) on MimicGen
low-dim datasets. DDP training, EMA weights, periodic checkpoints with resume.

    torchrun --nproc_per_node=4 18_flow_matching_mimicgen.py --data data/mimicgen/stack_d1.hdf5
    torchrun --nproc_per_node=4 18_flow_matching_mimicgen.py --data data/mimicgen/stack_d1.hdf5 --resume runs/fm_stack/ckpt_latest.pt
"""
import argparse
import copy
import math
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run_dir", default="runs/fm_stack")
    p.add_argument("--resume", default="")
    p.add_argument("--obs_horizon", type=int, default=2)
    p.add_argument("--pred_horizon", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--flow_steps", type=int, default=10)
    p.add_argument("--ckpt_every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


OBS_KEYS = ["object", "robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"]


class ChunkDataset(Dataset):
    def __init__(self, path, To, H):
        obs, act, self.index = [], [], []
        with h5py.File(path, "r") as f:
            off = 0
            for k in sorted(f["data"].keys(), key=lambda s: int(s.split("_")[1])):
                g = f["data"][k]
                o = np.concatenate([g["obs"][x][()] for x in OBS_KEYS], -1)
                a = g["actions"][()]
                obs.append(o); act.append(a)
                n = len(a)
                for t in range(n):
                    self.index.append((off, off + n, off + t))
                off += n
        self.obs = np.concatenate(obs).astype(np.float32)
        self.act = np.concatenate(act).astype(np.float32)
        self.o_lo, self.o_hi = self.obs.min(0), self.obs.max(0)
        self.a_lo, self.a_hi = self.act.min(0), self.act.max(0)
        self.To, self.H = To, H

    def __len__(self):
        return len(self.index)

    @staticmethod
    def _n(x, lo, hi):
        return 2 * (x - lo) / np.maximum(hi - lo, 1e-5) - 1

    def __getitem__(self, i):
        s, e, t = self.index[i]
        oi = np.clip(np.arange(t - self.To + 1, t + 1), s, e - 1)
        ai = np.clip(np.arange(t, t + self.H), s, e - 1)
        return (torch.from_numpy(self._n(self.obs[oi], self.o_lo, self.o_hi).astype(np.float32)),
                torch.from_numpy(self._n(self.act[ai], self.a_lo, self.a_hi).astype(np.float32)))


class ResMLPBlock(nn.Module):
    def __init__(self, d, cond):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ada = nn.Linear(cond, 2 * d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, c):
        s, b = self.ada(c).chunk(2, -1)
        return x + self.ff(self.norm(x) * (1 + s) + b)


class FlowPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim, To, H, d, depth):
        super().__init__()
        self.H, self.act_dim = H, act_dim
        self.obs_enc = nn.Sequential(nn.Linear(To * obs_dim, d), nn.GELU(), nn.Linear(d, d))
        self.t_enc = nn.Sequential(nn.Linear(64, d), nn.GELU(), nn.Linear(d, d))
        self.inp = nn.Linear(H * act_dim, d)
        self.blocks = nn.ModuleList([ResMLPBlock(d, 2 * d) for _ in range(depth)])
        self.out = nn.Linear(d, H * act_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @staticmethod
    def fourier(t, dim=64):
        freqs = torch.exp(torch.linspace(0, math.log(1000), dim // 2, device=t.device))
        return torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], -1)

    def forward(self, x_t, t, obs):
        c = torch.cat([self.obs_enc(obs.flatten(1)), self.t_enc(self.fourier(t))], -1)
        h = self.inp(x_t.flatten(1))
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(h).view(-1, self.H, self.act_dim)

    @torch.no_grad()
    def sample(self, obs, steps):
        x = torch.randn(obs.shape[0], self.H, self.act_dim, device=obs.device)
        for i in range(steps):
            t = torch.full((obs.shape[0],), i / steps, device=obs.device)
            x = x + self(x, t, obs) / steps
        return x


@torch.no_grad()
def update_ema(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 1 - decay)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    ds = ChunkDataset(args.data, args.obs_horizon, args.pred_horizon)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    policy = FlowPolicy(ds.obs.shape[1], ds.act.shape[1], args.obs_horizon, args.pred_horizon,
                        args.hidden, args.depth).to(device)
    ema = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=1e-4)
    total_steps = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=total_steps, pct_start=0.02)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        policy.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    model = DDP(policy, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank)

    writer = None
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        writer = SummaryWriter(args.run_dir)

    # small fixed probe batch for tracking action reconstruction error of the EMA policy
    probe = [ds[i] for i in range(0, len(ds), max(1, len(ds) // 256))][:256]
    probe_obs = torch.stack([p[0] for p in probe]).to(device)
    probe_act = torch.stack([p[1] for p in probe]).to(device)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        for obs, act in dl:
            obs, act = obs.to(device, non_blocking=True), act.to(device, non_blocking=True)
            x0 = torch.randn_like(act)
            t = torch.rand(act.shape[0], device=device)
            x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * act
            v = model(x_t, t, obs)
            loss = F.mse_loss(v, act - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            update_ema(ema, model.module, args.ema)
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        if rank == 0:
            ema.eval()
            recon = F.mse_loss(ema.sample(probe_obs, args.flow_steps), probe_act).item()
            writer.add_scalar("train/flow_loss", (acc[0] / acc[1]).item(), epoch)
            writer.add_scalar("probe/ema_action_mse", recon, epoch)
            writer.add_scalar("train/lr", sched.get_last_lr()[0], epoch)
            if (epoch + 1) % args.ckpt_every == 0 or epoch + 1 == args.epochs:
                state = {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                         "sched": sched.state_dict(), "epoch": epoch,
                         "norm": {"o_lo": ds.o_lo, "o_hi": ds.o_hi, "a_lo": ds.a_lo, "a_hi": ds.a_hi}}
                torch.save(state, os.path.join(args.run_dir, f"ckpt_{epoch + 1:04d}.pt"))
                torch.save(state, os.path.join(args.run_dir, "ckpt_latest.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
