#!/usr/bin/env python3
"""
Diffusion Policy (transformer denoiser, low-dim keypoint obs) on Push-T, data-parallel.

Usage:
    torchrun --nproc_per_node=4 train_pusht_dp.py --zarr data/pusht/pusht_cchi_v7_replay.zarr
"""
import argparse
import collections
import math
import os
import random

import gym_pusht  # noqa: F401  (registers gym-pusht envs)
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from diffusers import DDIMScheduler, DDPMScheduler
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", required=True)
    p.add_argument("--out", default="data/outputs/pusht_dp_tf")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--horizon", type=int, default=16)
    p.add_argument("--n_obs", type=int, default=2)
    p.add_argument("--n_act", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=3000)
    p.add_argument("--rollout_every", type=int, default=50)
    p.add_argument("--n_rollouts", type=int, default=48)
    p.add_argument("--ckpt_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class PushTLowdim(Dataset):
    def __init__(self, path, horizon, pad_before, pad_after):
        root = zarr.open(path, "r")
        kp = root["data"]["keypoint"][:].reshape(len(root["data"]["keypoint"]), -1)
        self.obs = np.concatenate([kp, root["data"]["state"][:, :2]], -1).astype(np.float32)
        self.act = root["data"]["action"][:].astype(np.float32)
        ends = root["meta"]["episode_ends"][:]
        starts = np.concatenate([[0], ends[:-1]])
        self.idx = []
        for s, e in zip(starts, ends):
            for i in range(s - pad_before, e - horizon + pad_after + 1):
                self.idx.append((s, e, i))
        self.h = horizon
        self.obs_min, self.obs_max = self.obs.min(0), self.obs.max(0)
        self.act_min, self.act_max = self.act.min(0), self.act.max(0)

    def norm_obs(self, o):
        return 2 * (o - self.obs_min) / (self.obs_max - self.obs_min) - 1

    def norm_act(self, a):
        return 2 * (a - self.act_min) / (self.act_max - self.act_min) - 1

    def unnorm_act(self, a):
        return (a + 1) / 2 * (self.act_max - self.act_min) + self.act_min

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        s, e, start = self.idx[i]
        ids = np.clip(np.arange(start, start + self.h), s, e - 1)
        return torch.from_numpy(self.norm_obs(self.obs[ids])), torch.from_numpy(self.norm_act(self.act[ids]))


class TransformerDenoiser(nn.Module):
    def __init__(self, act_dim, obs_dim, horizon, n_obs, d=256, layers=8, heads=4):
        super().__init__()
        self.act_in = nn.Linear(act_dim, d)
        self.obs_in = nn.Linear(obs_dim, d)
        self.t_emb = nn.Sequential(nn.Linear(128, d), nn.Mish(), nn.Linear(d, d))
        self.pos = nn.Parameter(torch.zeros(1, horizon, d))
        self.cond_pos = nn.Parameter(torch.zeros(1, n_obs + 1, d))
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, 4 * d, 0.1, batch_first=True,
                                                                    norm_first=True), layers)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, act_dim)
        mask = torch.triu(torch.ones(horizon, horizon, dtype=torch.bool), 1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, noisy, t, obs):
        half = 64
        f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
        te = self.t_emb(torch.cat([(t[:, None] * f).sin(), (t[:, None] * f).cos()], -1))
        cond = torch.cat([te[:, None], self.obs_in(obs)], 1) + self.cond_pos
        x = self.act_in(noisy) + self.pos
        return self.out(self.ln(self.dec(x, cond, tgt_mask=self.causal)))


@torch.no_grad()
def run_rollouts(model, ds, args, device, n_episodes, seed0):
    sched = DDIMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True)
    sched.set_timesteps(16)
    env = gym.make("gym_pusht/PushT-v0", obs_type="environment_state_agent_pos", max_episode_steps=300)
    rewards = []
    for ep in range(n_episodes):
        obs, _ = env.reset(seed=seed0 + ep)
        hist = collections.deque([obs] * args.n_obs, maxlen=args.n_obs)
        best, done = 0.0, False
        while not done:
            o = torch.from_numpy(ds.norm_obs(np.stack(hist).astype(np.float32)))[None].to(device)
            a = torch.randn(1, args.horizon, ds.act.shape[-1], device=device)
            for t in sched.timesteps:
                a = sched.step(model(a, t.expand(1).to(device), o), t, a).prev_sample
            acts = ds.unnorm_act(a[0].cpu().numpy())[args.n_obs - 1: args.n_obs - 1 + args.n_act]
            for act in acts:
                obs, r, term, trunc, _ = env.step(act)
                hist.append(obs)
                best = max(best, r)
                if term or trunc:
                    done = True
                    break
        rewards.append(best)
    env.close()
    return rewards


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    device = torch.device("cuda", args.local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    ds = PushTLowdim(args.zarr, args.horizon, pad_before=args.n_obs - 1, pad_after=args.n_act - 1)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4,
                    pin_memory=True, persistent_workers=True, drop_last=True)

    obs_dim, act_dim = ds.obs.shape[-1], ds.act.shape[-1]
    model = TransformerDenoiser(act_dim, obs_dim, args.horizon, args.n_obs).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    ema = EMAModel(model.module.parameters(), power=0.75, model_cls=TransformerDenoiser)
    ema.to(device)
    noise_sched = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-3)
    total = args.epochs * len(dl)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 1000) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="pusht-dp", config=vars(args))

    eval_model = TransformerDenoiser(act_dim, obs_dim, args.horizon, args.n_obs).to(device).eval()
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for obs, act in dl:
            obs, act = obs.to(device, non_blocking=True), act.to(device, non_blocking=True)
            noise = torch.randn_like(act)
            t = torch.randint(0, 100, (act.shape[0],), device=device)
            pred = model(noise_sched.add_noise(act, noise, t), t, obs[:, : args.n_obs])
            loss = F.mse_loss(pred, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            lr_sched.step()
            ema.step(model.module.parameters())
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": lr_sched.get_last_lr()[0]}, step=step)

        if (epoch + 1) % args.rollout_every == 0:
            # each rank rolls out its own slice of the seeds; mean max-coverage is all-reduced
            ema.copy_to(eval_model.parameters())
            per_rank = args.n_rollouts // world
            rew = run_rollouts(eval_model, ds, args, device, per_rank, seed0=100_000 + rank * per_rank)
            stat = torch.tensor([sum(rew), len(rew)], dtype=torch.float64, device=device)
            dist.all_reduce(stat)
            if rank == 0:
                wandb.log({"eval/mean_score": (stat[0] / stat[1]).item(), "epoch": epoch}, step=step)

        if rank == 0 and (epoch + 1) % args.ckpt_every == 0:
            torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "normalizer": (ds.obs_min, ds.obs_max, ds.act_min, ds.act_max)},
                       os.path.join(args.out, f"epoch={epoch:04d}.ckpt"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
