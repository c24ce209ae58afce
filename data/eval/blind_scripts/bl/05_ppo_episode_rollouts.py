"""
Episodic PPO for continuous-control tasks (BipedalWalker, LunarLanderContinuous...).

Each worker collects complete episodes so that returns can be computed
without bootstrapping from a truncated rollout; the Gaussian policy and the
value function share one module that is trained with DDP.

    torchrun --nproc_per_node=4 05_ppo_episode_rollouts.py --env BipedalWalker-v3 --episodes-per-rank 8
"""
import argparse
import json
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="BipedalWalker-v3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--episodes-per-rank", type=int, default=8)
    p.add_argument("--max-episode-steps", type=int, default=1600)
    p.add_argument("--minibatch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--ckpt-dir", default="checkpoints/ppo_episodic")
    p.add_argument("--ckpt-every", type=int, default=25)
    return p.parse_args()


class RunningMeanStd:
    """Observation normaliser; statistics are merged across ranks every iteration."""

    def __init__(self, shape, device):
        self.mean = torch.zeros(shape, dtype=torch.float64, device=device)
        self.var = torch.ones(shape, dtype=torch.float64, device=device)
        self.count = torch.tensor(1e-4, dtype=torch.float64, device=device)

    def update(self, x):
        x = x.to(torch.float64)
        n = torch.tensor(float(x.shape[0]), dtype=torch.float64, device=x.device)
        s = x.sum(0)
        sq = (x * x).sum(0)
        packed = torch.cat([n.view(1), s, sq])
        dist.all_reduce(packed)
        n, s, sq = packed[0], packed[1:1 + x.shape[1]], packed[1 + x.shape[1]:]
        batch_mean = s / n
        batch_var = sq / n - batch_mean ** 2
        delta = batch_mean - self.mean
        tot = self.count + n
        self.mean = self.mean + delta * n / tot
        m2 = self.var * self.count + batch_var * n + delta ** 2 * self.count * n / tot
        self.var = m2 / tot
        self.count = tot

    def normalize(self, x):
        return ((x - self.mean.float()) / torch.sqrt(self.var.float() + 1e-8)).clamp(-10, 10)


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden=64):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                nn.Linear(hidden, act_dim))
        self.v = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                               nn.Linear(hidden, 1))
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def forward(self, obs, act=None):
        mu = self.pi(obs)
        dist_ = Normal(mu, self.log_std.exp())
        if act is None:
            act = dist_.sample()
        return act, dist_.log_prob(act).sum(-1), dist_.entropy().sum(-1), self.v(obs).squeeze(-1)


def collect_episodes(env, model, obs_rms, n_episodes, max_steps, device):
    obs_l, act_l, logp_l, rew_l, val_l, done_l, ep_returns = [], [], [], [], [], [], []
    raw_obs = []
    for _ in range(n_episodes):
        o, _ = env.reset()
        ep_ret = 0.0
        for t in range(max_steps):
            raw_obs.append(o)
            ot = obs_rms.normalize(torch.as_tensor(o, dtype=torch.float32, device=device))
            with torch.no_grad():
                a, logp, _, v = model(ot.unsqueeze(0))
            a_np = a.squeeze(0).cpu().numpy()
            o, r, term, trunc, _ = env.step(np.clip(a_np, env.action_space.low, env.action_space.high))
            obs_l.append(ot)
            act_l.append(a.squeeze(0))
            logp_l.append(logp.squeeze(0))
            val_l.append(v.squeeze(0))
            rew_l.append(float(r))
            ep_ret += r
            last = term or trunc or t == max_steps - 1
            done_l.append(last)
            if last:
                break
        ep_returns.append(ep_ret)
    return (torch.stack(obs_l), torch.stack(act_l), torch.stack(logp_l), torch.stack(val_l),
            np.array(rew_l, dtype=np.float32), np.array(done_l), ep_returns, np.array(raw_obs))


def compute_gae(rewards, values, dones, gamma, lam):
    adv = np.zeros_like(rewards)
    values = values.cpu().numpy()
    last = 0.0
    for t in reversed(range(len(rewards))):
        next_v = 0.0 if dones[t] else values[t + 1]
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * (0.0 if dones[t] else last)
        adv[t] = last
    return adv, adv + values


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    env = gym.make(args.env)
    env.reset(seed=args.seed + rank)
    env.action_space.seed(args.seed + rank)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]

    model = ActorCritic(obs_dim, act_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    obs_rms = RunningMeanStd(obs_dim, device)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        with open(os.path.join(args.ckpt_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    for it in range(1, args.iterations + 1):
        t0 = time.time()
        obs, act, logp_old, val, rew, done, ep_rets, raw = collect_episodes(
            env, model.module, obs_rms, args.episodes_per_rank, args.max_episode_steps, device)
        adv, ret = compute_gae(rew, val, done, args.gamma, args.lam)
        adv = torch.as_tensor(adv, device=device)
        ret = torch.as_tensor(ret, device=device)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)

        n = obs.shape[0]
        for epoch in range(args.epochs):
            perm = torch.randperm(n, device=device)
            for start in range(0, n, args.minibatch_size):
                idx = perm[start:start + args.minibatch_size]
                _, logp, ent, v = model(obs[idx], act[idx])
                ratio = (logp - logp_old[idx]).exp()
                s1 = ratio * adv[idx]
                s2 = ratio.clamp(1 - args.clip, 1 + args.clip) * adv[idx]
                pi_loss = -torch.min(s1, s2).mean()
                v_loss = (v - ret[idx]).pow(2).mean()
                loss = pi_loss + args.vf_coef * v_loss - args.ent_coef * ent.mean()
                optim.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optim.step()

        obs_rms.update(torch.as_tensor(raw, device=device))

        stats = torch.tensor([sum(ep_rets), len(ep_rets), n, pi_loss.item(), v_loss.item()],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"it {it:5d} | return {stats[0] / stats[1]:8.2f} | steps {int(stats[2])} | "
                  f"pi {stats[3] / world_size:.4f} v {stats[4] / world_size:.4f} | {time.time() - t0:.1f}s",
                  flush=True)

        if it % args.ckpt_every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(),
                        "optim": optim.state_dict(),
                        "obs_rms": (obs_rms.mean.cpu(), obs_rms.var.cpu(), obs_rms.count.cpu()),
                        "iteration": it},
                       os.path.join(args.ckpt_dir, f"ppo_{it:05d}.pt"))

    env.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
