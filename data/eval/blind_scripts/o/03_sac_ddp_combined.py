#!/usr/bin/env python
# SAC for MuJoCo, data-parallel: every GPU runs its own env + replay buffer,
# gradients are averaged with DDP. Fixed temperature (autotune was unstable for us).
import argparse
import copy
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

LOG_STD_MIN, LOG_STD_MAX = -5, 2


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="HalfCheetah-v4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-steps", type=int, default=1_000_000)
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-starts", type=int, default=5000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--policy-lr", type=float, default=3e-4)
    p.add_argument("--q-lr", type=float, default=1e-3)
    p.add_argument("--policy-freq", type=int, default=2)
    p.add_argument("--out", default="checkpoints/sac")
    return p.parse_args()


class ReplayBuffer:
    def __init__(self, obs_dim, act_dim, size, device):
        self.obs = np.zeros((size, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((size, obs_dim), dtype=np.float32)
        self.act = np.zeros((size, act_dim), dtype=np.float32)
        self.rew = np.zeros((size, 1), dtype=np.float32)
        self.done = np.zeros((size, 1), dtype=np.float32)
        self.ptr, self.size, self.max_size = 0, 0, size
        self.device = device

    def add(self, o, a, r, o2, d):
        self.obs[self.ptr] = o
        self.act[self.ptr] = a
        self.rew[self.ptr] = r
        self.next_obs[self.ptr] = o2
        self.done[self.ptr] = d
        self.ptr = (self.ptr + 1) % self.max_size
        self.size = min(self.size + 1, self.max_size)

    def sample(self, n):
        idx = np.random.randint(0, self.size, size=n)
        to = lambda x: torch.as_tensor(x[idx], device=self.device)
        return to(self.obs), to(self.act), to(self.rew), to(self.next_obs), to(self.done)


def mlp(inp, out, hidden=256):
    return nn.Sequential(nn.Linear(inp, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out))


class SACAgent(nn.Module):
    """Actor + twin critics in one module so we only need one DDP wrapper."""

    def __init__(self, obs_dim, act_dim, act_low, act_high):
        super().__init__()
        self.q1 = mlp(obs_dim + act_dim, 1)
        self.q2 = mlp(obs_dim + act_dim, 1)
        self.pi_body = mlp(obs_dim, 256)
        self.pi_mean = nn.Linear(256, act_dim)
        self.pi_logstd = nn.Linear(256, act_dim)
        self.register_buffer("action_scale", torch.tensor((act_high - act_low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((act_high + act_low) / 2.0, dtype=torch.float32))

    def q(self, obs, act):
        x = torch.cat([obs, act], 1)
        return self.q1(x), self.q2(x)

    def pi(self, obs):
        h = F.relu(self.pi_body(obs))
        mean = self.pi_mean(h)
        log_std = torch.tanh(self.pi_logstd(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        std = log_std.exp()
        normal = torch.distributions.Normal(mean, std)
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t)
        log_prob -= torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        log_prob = log_prob.sum(1, keepdim=True)
        mean = torch.tanh(mean) * self.action_scale + self.action_bias
        return action, log_prob, mean

    def forward(self, obs, act=None, mode="pi"):
        if mode == "q":
            return self.q(obs, act)
        action, log_prob, _ = self.pi(obs)
        q1, q2 = self.q(obs, action)
        return action, log_prob, torch.min(q1, q2)


def soft_update(target, source, tau):
    with torch.no_grad():
        for tp, p in zip(target.parameters(), source.parameters()):
            tp.data.mul_(1 - tau).add_(tau * p.data)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    env = gym.make(args.env_id)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env.action_space.seed(args.seed + rank)
    obs_dim = env.observation_space.shape[0]
    act_dim = env.action_space.shape[0]

    agent = SACAgent(obs_dim, act_dim, env.action_space.low, env.action_space.high).to(device)
    target = copy.deepcopy(agent)
    for p in target.parameters():
        p.requires_grad_(False)
    agent = DDP(agent, device_ids=[local_rank])
    net = agent.module

    q_params = list(net.q1.parameters()) + list(net.q2.parameters())
    pi_params = list(net.pi_body.parameters()) + list(net.pi_mean.parameters()) + list(net.pi_logstd.parameters())
    q_opt = torch.optim.Adam(q_params, lr=args.q_lr)
    pi_opt = torch.optim.Adam(pi_params, lr=args.policy_lr)

    rb = ReplayBuffer(obs_dim, act_dim, args.buffer_size, device)
    steps_per_rank = args.total_steps // world

    obs, _ = env.reset(seed=args.seed + rank)
    t0 = time.time()
    ep_returns = []
    for step in range(steps_per_rank):
        if step < args.learning_starts:
            action = env.action_space.sample()
        else:
            with torch.no_grad():
                a, _, _ = net.pi(torch.as_tensor(obs, device=device, dtype=torch.float32)[None])
            action = a[0].cpu().numpy()

        next_obs, reward, terminated, truncated, info = env.step(action)
        rb.add(obs, action, reward, next_obs, float(terminated))
        obs = next_obs
        if terminated or truncated:
            if "episode" in info:
                ep_returns.append(float(info["episode"]["r"]))
            obs, _ = env.reset()

        if step < args.learning_starts:
            continue

        b_obs, b_act, b_rew, b_next, b_done = rb.sample(args.batch_size)
        with torch.no_grad():
            next_a, next_logp, _ = target.pi(b_next)
            tq1, tq2 = target.q(b_next, next_a)
            min_tq = torch.min(tq1, tq2) - args.alpha * next_logp
            y = b_rew + (1 - b_done) * args.gamma * min_tq

        q1, q2 = agent(b_obs, b_act, mode="q")
        q_loss = F.mse_loss(q1, y) + F.mse_loss(q2, y)
        q_opt.zero_grad()
        q_loss.backward()
        q_opt.step()

        if step % args.policy_freq == 0:
            for _ in range(args.policy_freq):
                _, logp, min_q = agent(b_obs, mode="pi")
                pi_loss = (args.alpha * logp - min_q).mean()
                pi_opt.zero_grad()
                pi_loss.backward()
                pi_opt.step()

        soft_update(target, net, args.tau)

        if step % 5000 == 0:
            stats = torch.tensor(
                [np.mean(ep_returns[-10:]) if ep_returns else 0.0, q_loss.item(), pi_loss.item()], device=device
            )
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                sps = int(step * world / (time.time() - t0))
                print(
                    f"step {step * world} return {stats[0]:.1f} q_loss {stats[1]:.3f} pi_loss {stats[2]:.3f} SPS {sps}",
                    flush=True,
                )

        if rank == 0 and step % 100_000 == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"agent": net.state_dict(), "step": step}, os.path.join(args.out, f"sac_{step}.pt"))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"agent": net.state_dict(), "step": steps_per_rank}, os.path.join(args.out, "sac_final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
