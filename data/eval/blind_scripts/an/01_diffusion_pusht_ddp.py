"""Diffusion policy (state-based) on Push-T, multi-GPU training with EMA.

Launch:
    torchrun --standalone --nproc_per_node=4 01_diffusion_pusht_ddp.py --zarr data/pusht/pusht_cchi_v7_replay.zarr
"""
import argparse
import collections
import copy
import os
import time

import gym_pusht  # noqa: F401  (registers gym_pusht/PushT-v0)
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import zarr
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", type=str, required=True)
    p.add_argument("--out_dir", type=str, default="outputs/dp_pusht")
    p.add_argument("--n_obs_steps", type=int, default=2)
    p.add_argument("--horizon", type=int, default=16)
    p.add_argument("--n_action_steps", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--num_diffusion_steps", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--n_eval_episodes", type=int, default=64)
    p.add_argument("--eval_seed", type=int, default=100000)
    p.add_argument("--max_episode_steps", type=int, default=300)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--wandb_project", type=str, default="diffusion-pusht")
    return p.parse_args()


class PushTStateDataset(Dataset):
    """Samples (obs[t-To+1:t+1], action[t-To+1:t-To+1+H]) windows inside episodes."""

    def __init__(self, zarr_path, horizon, n_obs_steps):
        root = zarr.open(zarr_path, "r")
        self.obs = root["data/state"][:].astype(np.float32)
        self.action = root["data/action"][:].astype(np.float32)
        episode_ends = root["meta/episode_ends"][:]
        self.horizon = horizon
        self.n_obs_steps = n_obs_steps

        self.indices = []
        start = 0
        for end in episode_ends:
            # pad so every step of every episode can be the first obs of a window
            for i in range(start - (n_obs_steps - 1), end - horizon + n_obs_steps):
                self.indices.append((start, end, i))
            start = end

        self.stats = {
            "obs": {"min": self.obs.min(0), "max": self.obs.max(0)},
            "action": {"min": self.action.min(0), "max": self.action.max(0)},
        }

    def __len__(self):
        return len(self.indices)

    def _window(self, arr, ep_start, ep_end, i, length):
        idx = np.clip(np.arange(i, i + length), ep_start, ep_end - 1)
        return arr[idx]

    def __getitem__(self, k):
        ep_start, ep_end, i = self.indices[k]
        obs = self._window(self.obs, ep_start, ep_end, i, self.n_obs_steps)
        act = self._window(self.action, ep_start, ep_end, i, self.horizon)
        return {
            "obs": torch.from_numpy(normalize(obs, self.stats["obs"])),
            "action": torch.from_numpy(normalize(act, self.stats["action"])),
        }


def normalize(x, s):
    return ((x - s["min"]) / (s["max"] - s["min"] + 1e-8) * 2.0 - 1.0).astype(np.float32)


def unnormalize(x, s):
    return (x + 1.0) / 2.0 * (s["max"] - s["min"] + 1e-8) + s["min"]


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        half = self.dim // 2
        freqs = torch.exp(-np.log(10000) * torch.arange(half, device=t.device) / (half - 1))
        emb = t.float()[:, None] * freqs[None]
        return torch.cat([emb.sin(), emb.cos()], dim=-1)


class NoisePredictor(nn.Module):
    def __init__(self, obs_dim, act_dim, horizon, n_obs_steps, hidden=1024):
        super().__init__()
        self.horizon, self.act_dim = horizon, act_dim
        self.t_emb = nn.Sequential(SinusoidalPosEmb(128), nn.Linear(128, 256), nn.Mish())
        in_dim = horizon * act_dim + n_obs_steps * obs_dim + 256
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.Mish(),
            nn.Linear(hidden, hidden), nn.Mish(),
            nn.Linear(hidden, hidden), nn.Mish(),
            nn.Linear(hidden, horizon * act_dim),
        )

    def forward(self, noisy_action, t, obs):
        b = noisy_action.shape[0]
        h = torch.cat([noisy_action.reshape(b, -1), obs.reshape(b, -1), self.t_emb(t)], dim=-1)
        return self.net(h).reshape(b, self.horizon, self.act_dim)


@torch.no_grad()
def sample_actions(model, scheduler, obs, horizon, act_dim, num_steps):
    x = torch.randn(obs.shape[0], horizon, act_dim, device=obs.device)
    scheduler.set_timesteps(num_steps)
    for t in scheduler.timesteps:
        eps = model(x, t.expand(x.shape[0]).to(obs.device), obs)
        x = scheduler.step(eps, t, x).prev_sample
    return x


@torch.no_grad()
def evaluate(model, scheduler, stats, args, rank, world_size, device):
    env = gym.make("gym_pusht/PushT-v0", obs_type="state", max_episode_steps=args.max_episode_steps)
    seeds = range(args.eval_seed + rank, args.eval_seed + args.n_eval_episodes, world_size)
    successes, max_rewards = [], []
    for seed in seeds:
        obs, info = env.reset(seed=seed)
        hist = collections.deque([obs] * args.n_obs_steps, maxlen=args.n_obs_steps)
        done, best = False, 0.0
        while not done:
            o = torch.from_numpy(normalize(np.stack(hist), stats["obs"])).unsqueeze(0).to(device)
            a = sample_actions(model, scheduler, o, args.horizon, 2, args.num_diffusion_steps)
            a = unnormalize(a[0].cpu().numpy(), stats["action"])
            start = args.n_obs_steps - 1
            for act in a[start:start + args.n_action_steps]:
                obs, reward, terminated, truncated, info = env.step(act)
                hist.append(obs)
                best = max(best, float(reward))
                if terminated or truncated:
                    done = True
                    break
        successes.append(float(info.get("is_success", best > 0.95)))
        max_rewards.append(best)
    env.close()
    return {"success_rate": float(np.mean(successes)), "mean_max_reward": float(np.mean(max_rewards))}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    dataset = PushTStateDataset(args.zarr, args.horizon, args.n_obs_steps)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True,
                        persistent_workers=True)

    obs_dim, act_dim = dataset.obs.shape[1], dataset.action.shape[1]
    model = NoisePredictor(obs_dim, act_dim, args.horizon, args.n_obs_steps).to(device)
    ema_model = copy.deepcopy(model)
    ema = EMAModel(ema_model.parameters(), power=0.75)
    model = DDP(model, device_ids=[local_rank])

    scheduler = DDPMScheduler(num_train_timesteps=args.num_diffusion_steps,
                              beta_schedule="squaredcos_cap_v2", clip_sample=True,
                              prediction_type="epsilon")
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-6)
    total_steps = args.epochs * len(loader)
    lr_sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=args.lr, total_steps=total_steps,
                                                   pct_start=500 / total_steps)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for batch in loader:
            obs = batch["obs"].to(device, non_blocking=True)
            action = batch["action"].to(device, non_blocking=True)
            noise = torch.randn_like(action)
            t = torch.randint(0, scheduler.config.num_train_timesteps, (action.shape[0],), device=device)
            noisy = scheduler.add_noise(action, noise, t)
            loss = nn.functional.mse_loss(model(noisy, t, obs), noise)

            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            lr_sched.step()
            ema.step(model.module.parameters())
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            step += 1

        dist.all_reduce(running)
        if rank == 0:
            wandb.log({"train/loss": (running[0] / running[1]).item(), "train/lr": lr_sched.get_last_lr()[0],
                       "train/epoch_time": time.time() - t0, "epoch": epoch}, step=step)

        if (epoch + 1) % args.eval_every == 0 or epoch == args.epochs - 1:
            ema.copy_to(ema_model.parameters())
            ema_model.eval()
            metrics = evaluate(ema_model, scheduler, dataset.stats, args, rank, world_size, device)
            if rank == 0:
                wandb.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
                print(f"epoch {epoch}: success {metrics['success_rate']:.3f}")
                torch.save({
                    "epoch": epoch,
                    "model": model.module.state_dict(),
                    "ema": ema_model.state_dict(),
                    "optim": optim.state_dict(),
                    "stats": dataset.stats,
                    "args": vars(args),
                }, os.path.join(args.out_dir, f"epoch_{epoch:04d}.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
