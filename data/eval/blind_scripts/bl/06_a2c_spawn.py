"""Synchronous advantage actor-critic (A2C), one process per GPU started with mp.spawn.

    python 06_a2c_spawn.py --env Acrobot-v1 --gpus 4
"""
import argparse
import os
import socket
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def build_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="Acrobot-v1")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--n-steps", type=int, default=5)
    parser.add_argument("--updates", type=int, default=50_000)
    parser.add_argument("--lr", type=float, default=7e-4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--value-coef", type=float, default=0.5)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--logdir", default="runs/a2c")
    parser.add_argument("--save-every", type=int, default=5_000)
    return parser


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Policy(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=128):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.logits = nn.Linear(hidden, n_actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.body(x)
        return self.logits(h), self.value(h).squeeze(-1)


def run(rank, cfg, world_size):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)

    envs = gym.vector.SyncVectorEnv([lambda: gym.make(cfg.env) for _ in range(cfg.num_envs)])
    envs = gym.wrappers.RecordEpisodeStatistics(envs)
    obs_dim = envs.single_observation_space.shape[0]
    n_actions = envs.single_action_space.n

    model = DDP(Policy(obs_dim, n_actions).to(device), device_ids=[rank])
    optimizer = torch.optim.RMSprop(model.parameters(), lr=cfg.lr, alpha=0.99, eps=1e-5)
    writer = SummaryWriter(cfg.logdir) if rank == 0 else None

    obs, _ = envs.reset(seed=cfg.seed + 1000 * rank)
    obs = torch.as_tensor(obs, dtype=torch.float32, device=device)
    recent = deque(maxlen=100)
    t_start = time.time()

    for update in range(1, cfg.updates + 1):
        obs_buf, act_buf, rewards, masks = [], [], [], []
        for _ in range(cfg.n_steps):
            with torch.no_grad():
                logits, _ = model.module(obs)
            action = torch.distributions.Categorical(logits=logits).sample()
            next_obs, r, term, trunc, info = envs.step(action.cpu().numpy())
            done = np.logical_or(term, trunc)
            for i in np.nonzero(done)[0]:
                if "episode" in info:
                    recent.append(float(info["episode"]["r"][i]))
            obs_buf.append(obs)
            act_buf.append(action)
            rewards.append(torch.as_tensor(r, dtype=torch.float32, device=device))
            masks.append(torch.as_tensor(1.0 - term, dtype=torch.float32, device=device))
            obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)

        with torch.no_grad():
            _, next_value = model.module(obs)
            returns = []
            R = next_value
            for r, m in zip(reversed(rewards), reversed(masks)):
                R = r + cfg.gamma * R * m
                returns.insert(0, R)
            returns = torch.stack(returns)

        # one forward over the whole rollout (n_steps * num_envs) for the gradient
        logits, values = model(torch.cat(obs_buf))
        values = values.view(cfg.n_steps, cfg.num_envs)
        dist_ = torch.distributions.Categorical(logits=logits)
        log_probs = dist_.log_prob(torch.cat(act_buf)).view(cfg.n_steps, cfg.num_envs)
        advantages = returns - values

        policy_loss = -(log_probs * advantages.detach()).mean()
        value_loss = F.mse_loss(values, returns)
        entropy = dist_.entropy().mean()
        loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy

        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()

        if update % 100 == 0:
            ep = torch.tensor([sum(recent), len(recent)], dtype=torch.float32, device=device)
            dist.all_reduce(ep)
            if rank == 0:
                mean_ret = (ep[0] / ep[1].clamp(min=1)).item()
                frames = update * cfg.n_steps * cfg.num_envs * world_size
                fps = frames / (time.time() - t_start)
                writer.add_scalar("train/return", mean_ret, frames)
                writer.add_scalar("train/policy_loss", policy_loss.item(), frames)
                writer.add_scalar("train/value_loss", value_loss.item(), frames)
                writer.add_scalar("train/entropy", entropy.item(), frames)
                writer.add_scalar("train/fps", fps, frames)
                if update % 1000 == 0:
                    print(f"update {update} frames {frames} return {mean_ret:.1f} fps {fps:.0f}")

        if update % cfg.save_every == 0 and rank == 0:
            os.makedirs(cfg.logdir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "update": update}, os.path.join(cfg.logdir, f"a2c_{update}.pt"))

    envs.close()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    cfg = build_parser().parse_args()
    world_size = cfg.gpus
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(run, args=(world_size, cfg), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
