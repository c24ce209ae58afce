"""Data-parallel PPO: every rank runs its own copy of the environment, gradients are
averaged by DDP. Works for gymnasium classic-control / box2d tasks.

    torchrun --standalone --nproc_per_node=4 ppo_ddp.py --env LunarLander-v2 --total-updates 2000
"""
import argparse
import os
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="LunarLander-v2")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-updates", type=int, default=2000)
    p.add_argument("--episodes-per-update", type=int, default=8)
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--minibatch-size", type=int, default=256)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--save-dir", default="checkpoints/ppo")
    return p.parse_args()


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=128):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, n_actions)
        self.v = nn.Linear(hidden, 1)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.orthogonal_(m.weight, np.sqrt(2))
                nn.init.zeros_(m.bias)
        nn.init.orthogonal_(self.pi.weight, 0.01)
        nn.init.orthogonal_(self.v.weight, 1.0)

    def forward(self, obs):
        h = self.body(obs)
        return self.pi(h), self.v(h).squeeze(-1)


@torch.no_grad()
def collect_episodes(env, policy, n_episodes, device):
    obs_buf, act_buf, logp_buf, rew_buf, val_buf, done_buf, ep_returns = [], [], [], [], [], [], []
    for _ in range(n_episodes):
        obs, _ = env.reset()
        done, ep_ret = False, 0.0
        while not done:
            o = torch.as_tensor(obs, dtype=torch.float32, device=device)
            logits, value = policy(o[None])
            dist_ = Categorical(logits=logits)
            a = dist_.sample()
            obs2, r, term, trunc, _ = env.step(a.item())
            done = term or trunc
            obs_buf.append(o)
            act_buf.append(a[0])
            logp_buf.append(dist_.log_prob(a)[0])
            val_buf.append(value[0])
            rew_buf.append(float(r))
            done_buf.append(float(done))
            ep_ret += r
            obs = obs2
        ep_returns.append(ep_ret)
    return (torch.stack(obs_buf), torch.stack(act_buf), torch.stack(logp_buf), torch.stack(val_buf),
            torch.tensor(rew_buf, device=device), torch.tensor(done_buf, device=device), ep_returns)


def gae(rewards, values, dones, gamma, lam):
    adv = torch.zeros_like(rewards)
    last = 0.0
    for t in reversed(range(len(rewards))):
        next_v = 0.0 if dones[t] > 0 else values[t + 1]
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * (1.0 - dones[t]) * last
        adv[t] = last
    return adv, adv + values


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    env = gym.make(args.env)
    env.reset(seed=args.seed + 1000 * rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    model = ActorCritic(env.observation_space.shape[0], env.action_space.n).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr, eps=1e-5)
    recent = deque(maxlen=100)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    t0 = time.time()
    for update in range(1, args.total_updates + 1):
        frac = 1.0 - (update - 1.0) / args.total_updates
        optimizer.param_groups[0]["lr"] = frac * args.lr

        model.eval()
        obs, acts, old_logp, vals, rews, dones, ep_returns = collect_episodes(
            env, model, args.episodes_per_update, device)
        recent.extend(ep_returns)
        adv, returns = gae(rews, vals, dones, args.gamma, args.lam)

        model.train()
        n = obs.shape[0]
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(n, device=device)
            for start in range(0, n, args.minibatch_size):
                idx = perm[start:start + args.minibatch_size]
                logits, v = ddp_model(obs[idx])
                d = Categorical(logits=logits)
                logp = d.log_prob(acts[idx])
                ratio = (logp - old_logp[idx]).exp()
                mb_adv = adv[idx]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
                v_loss = 0.5 * (returns[idx] - v).pow(2).mean()
                loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * d.entropy().mean()
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(ddp_model.parameters(), args.max_grad_norm)
                optimizer.step()

        if update % 10 == 0:
            stats = torch.tensor([sum(ep_returns), len(ep_returns), n], dtype=torch.float64, device=device)
            dist.all_reduce(stats)
            if rank == 0:
                print(f"update {update} mean_return {stats[0] / stats[1]:.1f} "
                      f"steps {int(stats[2])} last100(rank0) {np.mean(recent):.1f} "
                      f"{time.time() - t0:.0f}s", flush=True)
        if update % 200 == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "update": update},
                       os.path.join(args.save_dir, f"ppo_{update}.pt"))

    env.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
