"""PPO on ManiSkill state-based manipulation tasks; one learner per GPU, each with its
own CPU simulator instances. Rollouts are collected as whole episodes.

    torchrun --standalone --nproc_per_node=4 10_ppo_maniskill_episodes.py --env_id PickCube-v1
"""
import argparse
import os
import time
from collections import defaultdict

import gymnasium as gym
import mani_skill.envs  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
import wandb


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env_id", default="PickCube-v1")
    p.add_argument("--control_mode", default="pd_ee_delta_pos")
    p.add_argument("--episodes_per_iter", type=int, default=16, help="per rank")
    p.add_argument("--max_episode_steps", type=int, default=100)
    p.add_argument("--iterations", type=int, default=3000)
    p.add_argument("--minibatch_size", type=int, default=512)
    p.add_argument("--ppo_epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.8)
    p.add_argument("--lam", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--target_kl", type=float, default=0.1)
    p.add_argument("--vf_coef", type=float, default=0.5)
    p.add_argument("--ent_coef", type=float, default=0.0)
    p.add_argument("--save_dir", default="ckpt/ppo_maniskill")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Agent(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, act_dim))
        self.v = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                               nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))

    def forward(self, obs, act):
        mean = self.pi(obs)
        d = torch.distributions.Normal(mean, self.log_std.exp())
        return d.log_prob(act).sum(-1), d.entropy().sum(-1), self.v(obs).squeeze(-1)

    @torch.no_grad()
    def step(self, obs):
        mean = self.pi(obs)
        d = torch.distributions.Normal(mean, self.log_std.exp())
        a = d.sample()
        return a, d.log_prob(a).sum(-1), self.v(obs).squeeze(-1)


def collect_episodes(env, agent, n_episodes, device, gamma, lam):
    buf = defaultdict(list)
    returns, successes, lengths = [], [], []
    for _ in range(n_episodes):
        obs, _ = env.reset()
        ep_obs, ep_act, ep_logp, ep_val, ep_rew = [], [], [], [], []
        done, success = False, False
        while not done:
            o = torch.as_tensor(obs, dtype=torch.float32, device=device).view(1, -1)
            a, logp, v = agent.step(o)
            obs, r, term, trunc, info = env.step(a[0].cpu().numpy())
            ep_obs.append(o[0]); ep_act.append(a[0]); ep_logp.append(logp[0]); ep_val.append(v[0])
            ep_rew.append(float(r))
            success = success or bool(info.get("success", False))
            done = bool(term) or bool(trunc)
        last_v = 0.0 if term else agent.step(torch.as_tensor(obs, dtype=torch.float32, device=device).view(1, -1))[2][0].item()
        vals = torch.stack(ep_val).cpu().numpy().tolist() + [last_v]
        adv, gae = np.zeros(len(ep_rew), np.float32), 0.0
        for t in reversed(range(len(ep_rew))):
            delta = ep_rew[t] + gamma * vals[t + 1] - vals[t]
            gae = delta + gamma * lam * gae
            adv[t] = gae
        buf["obs"] += ep_obs; buf["act"] += ep_act; buf["logp"] += ep_logp
        buf["adv"].append(torch.from_numpy(adv))
        buf["ret"].append(torch.from_numpy(adv) + torch.tensor(vals[:-1]))
        returns.append(sum(ep_rew)); successes.append(float(success)); lengths.append(len(ep_rew))
    batch = {
        "obs": torch.stack(buf["obs"]), "act": torch.stack(buf["act"]), "logp": torch.stack(buf["logp"]),
        "adv": torch.cat(buf["adv"]).to(device), "ret": torch.cat(buf["ret"]).float().to(device),
    }
    return batch, returns, successes, lengths


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    env = gym.make(args.env_id, obs_mode="state", control_mode=args.control_mode,
                   max_episode_steps=args.max_episode_steps, num_envs=1, sim_backend="cpu")
    env.reset(seed=args.seed * 1000 + rank)
    obs_dim = int(np.prod(env.observation_space.shape))
    act_dim = int(np.prod(env.action_space.shape))

    agent = Agent(obs_dim, act_dim).to(device)
    model = DDP(agent, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        wandb.init(project="ppo-maniskill", config=vars(args), name=f"{args.env_id}-ddp{world}")

    for it in range(args.iterations):
        t0 = time.time()
        batch, rets, succ, lens = collect_episodes(env, model.module, args.episodes_per_iter, device,
                                                   args.gamma, args.lam)
        t_collect = time.time() - t0

        # global advantage normalisation
        adv = batch["adv"]
        mom = torch.stack([adv.sum(), adv.pow(2).sum(), torch.tensor(float(adv.numel()), device=device)])
        dist.all_reduce(mom)
        mean = mom[0] / mom[2]
        std = (mom[1] / mom[2] - mean.pow(2)).clamp_min(1e-8).sqrt()
        batch["adv"] = (adv - mean) / (std + 1e-8)

        n = batch["obs"].shape[0]
        stop = False
        for epoch in range(args.ppo_epochs):
            perm = torch.randperm(n, device=device)
            for start in range(0, n - args.minibatch_size + 1, args.minibatch_size):
                idx = perm[start:start + args.minibatch_size]
                logp, ent, v = model(batch["obs"][idx], batch["act"][idx])
                log_ratio = logp - batch["logp"][idx]
                ratio = log_ratio.exp()
                mb_adv = batch["adv"][idx]
                pg = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip, 1 + args.clip)).mean()
                v_loss = 0.5 * (v - batch["ret"][idx]).pow(2).mean()
                loss = pg + args.vf_coef * v_loss - args.ent_coef * ent.mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - log_ratio).mean()
                    dist.all_reduce(approx_kl)
                    approx_kl /= world
                if approx_kl > args.target_kl:
                    stop = True
                    break
            if stop:
                break

        s = torch.tensor([sum(rets), sum(succ), sum(lens), len(rets)], device=device, dtype=torch.float64)
        dist.all_reduce(s)
        if rank == 0:
            wandb.log({"rollout/return": (s[0] / s[3]).item(), "rollout/success": (s[1] / s[3]).item(),
                       "rollout/ep_len": (s[2] / s[3]).item(), "loss/pg": pg.item(), "loss/v": v_loss.item(),
                       "time/collect": t_collect, "time/iter": time.time() - t0, "ppo/kl": approx_kl.item()},
                      step=it)
            if (it + 1) % 100 == 0:
                torch.save({"agent": model.module.state_dict(), "opt": opt.state_dict(), "iter": it},
                           os.path.join(args.save_dir, f"agent_{it + 1}.pt"))

    env.close()
    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
