# PPO (continuous control) on MuJoCo, one env worker per GPU, DDP for the update.
# Rollouts are collected in whole episodes so GAE never has to bootstrap across a cut.
#
#   torchrun --standalone --nproc_per_node=4 12_ppo_mujoco_episodes.py --env Humanoid-v4
import argparse
import os
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="Humanoid-v4")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--min-steps-per-rank", type=int, default=4096)
    ap.add_argument("--minibatch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--ent", type=float, default=0.0)
    ap.add_argument("--vf", type=float, default=0.5)
    ap.add_argument("--save-dir", default="ppo_mujoco")
    return ap.parse_args()


class RunningNorm:
    def __init__(self, shape, eps=1e-4):
        self.mean, self.var, self.count = np.zeros(shape), np.ones(shape), eps

    def update(self, x):
        bm, bv, bc = x.mean(0), x.var(0), x.shape[0]
        delta, tot = bm - self.mean, self.count + bc
        self.mean = self.mean + delta * bc / tot
        self.var = (self.var * self.count + bv * bc + delta ** 2 * self.count * bc / tot) / tot
        self.count = tot

    def sync(self, device):
        # average the statistics over ranks so every policy sees the same normalisation
        t = torch.tensor(np.concatenate([self.mean, self.var]), device=device, dtype=torch.float64)
        dist.all_reduce(t)
        t /= dist.get_world_size()
        n = self.mean.shape[0]
        self.mean, self.var = t[:n].cpu().numpy(), t[n:].cpu().numpy()

    def __call__(self, x):
        return np.clip((x - self.mean) / np.sqrt(self.var + 1e-8), -10, 10)


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                nn.Linear(256, act_dim))
        self.v = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def forward(self, obs, act=None):
        mu = self.pi(obs)
        dist_ = Normal(mu, self.log_std.exp())
        if act is None:
            act = dist_.sample()
        return act, dist_.log_prob(act).sum(-1), dist_.entropy().sum(-1), self.v(obs).squeeze(-1)


def collect(env, model, norm, min_steps, device, gamma, lam, ep_returns):
    buf = {k: [] for k in ("obs", "act", "logp", "adv", "ret", "val")}
    raw_obs_all = []
    steps = 0
    while steps < min_steps:
        obs, _ = env.reset()
        ep_obs, ep_act, ep_logp, ep_rew, ep_val = [], [], [], [], []
        done, ep_ret = False, 0.0
        while not done:
            raw_obs_all.append(obs)
            o = torch.as_tensor(norm(obs), dtype=torch.float32, device=device)
            with torch.no_grad():
                a, logp, _, v = model(o[None])
            a = a[0].cpu().numpy()
            obs2, r, term, trunc, _ = env.step(np.clip(a, env.action_space.low, env.action_space.high))
            ep_obs.append(o)
            ep_act.append(torch.as_tensor(a, device=device))
            ep_logp.append(logp[0])
            ep_val.append(v[0].item())
            ep_rew.append(r)
            ep_ret += r
            obs, done = obs2, term or trunc
        last_v = 0.0
        if trunc and not term:
            with torch.no_grad():
                last_v = model(torch.as_tensor(norm(obs), dtype=torch.float32, device=device)[None])[3].item()
        vals = np.array(ep_val + [last_v])
        adv = np.zeros(len(ep_rew))
        gae = 0.0
        for t in reversed(range(len(ep_rew))):
            delta = ep_rew[t] + gamma * vals[t + 1] - vals[t]
            gae = delta + gamma * lam * gae
            adv[t] = gae
        buf["obs"] += ep_obs
        buf["act"] += ep_act
        buf["logp"] += ep_logp
        buf["adv"] += list(adv)
        buf["ret"] += list(adv + vals[:-1])
        buf["val"] += ep_val
        steps += len(ep_rew)
        ep_returns.append(ep_ret)
    out = {
        "obs": torch.stack(buf["obs"]), "act": torch.stack(buf["act"]), "logp": torch.stack(buf["logp"]),
        "adv": torch.tensor(buf["adv"], dtype=torch.float32, device=device),
        "ret": torch.tensor(buf["ret"], dtype=torch.float32, device=device),
    }
    return out, np.asarray(raw_obs_all)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    env = gym.make(args.env)
    env.reset(seed=args.seed + 100 * rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]

    model = DDP(ActorCritic(obs_dim, act_dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    norm = RunningNorm(obs_dim)
    ep_returns = deque(maxlen=50)
    t_start = time.time()

    for it in range(args.iterations):
        model.eval()
        batch, raw = collect(env, model, norm, args.min_steps_per_rank, device, args.gamma, args.lam, ep_returns)
        norm.update(raw)
        norm.sync(device)

        n = batch["obs"].shape[0]
        adv = (batch["adv"] - batch["adv"].mean()) / (batch["adv"].std() + 1e-8)
        model.train()
        for _ in range(args.epochs):
            perm = torch.randperm(n, device=device)
            for start in range(0, n - args.minibatch + 1, args.minibatch):
                idx = perm[start:start + args.minibatch]
                _, logp, ent, v = model(batch["obs"][idx], batch["act"][idx])
                ratio = (logp - batch["logp"][idx]).exp()
                s1 = ratio * adv[idx]
                s2 = ratio.clamp(1 - args.clip, 1 + args.clip) * adv[idx]
                pi_loss = -torch.min(s1, s2).mean()
                v_loss = (v - batch["ret"][idx]).pow(2).mean()
                loss = pi_loss + args.vf * v_loss - args.ent * ent.mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()

        stats = torch.tensor([np.mean(ep_returns) if ep_returns else 0.0, float(n)], device=device)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"iter {it} mean return {stats[0].item() / world:.1f} samples {int(stats[1].item())} "
                  f"pi {pi_loss.item():.3f} v {v_loss.item():.3f} elapsed {time.time() - t_start:.0f}s",
                  flush=True)
            if it % 50 == 0 or it == args.iterations - 1:
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "obs_mean": norm.mean, "obs_var": norm.var,
                            "iter": it}, os.path.join(args.save_dir, f"ppo_{args.env}_{it}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
