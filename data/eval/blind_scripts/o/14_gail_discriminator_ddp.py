"""GAIL on MuJoCo with a PPO generator. Multi-GPU: every rank runs its own vector env,
policy and discriminator are both DDP-wrapped.

torchrun --standalone --nproc_per_node=4 14_gail_discriminator_ddp.py \
    --env Hopper-v4 --expert data/hopper_expert_25traj.npz
"""
import argparse
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="Hopper-v4")
    ap.add_argument("--expert", default="data/hopper_expert_25traj.npz")
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--num-steps", type=int, default=256)
    ap.add_argument("--iters", type=int, default=1500)
    ap.add_argument("--ppo-epochs", type=int, default=10)
    ap.add_argument("--minibatches", type=int, default=8)
    ap.add_argument("--disc-steps", type=int, default=5)
    ap.add_argument("--disc-batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--disc-lr", type=float, default=1e-4)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--out", default="runs/gail")
    return ap.parse_args()


class Policy(nn.Module):
    def __init__(self, od, ad):
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(od, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, ad))
        self.v = nn.Sequential(nn.Linear(od, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.log_std = nn.Parameter(torch.zeros(ad))

    def forward(self, obs, act=None):
        d = Normal(self.mu(obs), self.log_std.exp())
        if act is None:
            act = d.sample()
        return act, d.log_prob(act).sum(-1), d.entropy().sum(-1), self.v(obs).squeeze(-1)


class Discriminator(nn.Module):
    def __init__(self, od, ad, hidden=256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(od + ad, hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 1),
        )

    def forward(self, obs, act):
        return self.net(torch.cat([obs, act], -1)).squeeze(-1)


def load_expert(path, device):
    d = np.load(path)
    return (torch.as_tensor(d["obs"], dtype=torch.float32, device=device),
            torch.as_tensor(d["actions"], dtype=torch.float32, device=device))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(3)
    np.random.seed(3 + rank)

    envs = gym.vector.SyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(args.env))
                                     for _ in range(args.num_envs)])
    od = envs.single_observation_space.shape[0]
    ad = envs.single_action_space.shape[0]
    exp_obs, exp_act = load_expert(args.expert, dev)

    policy = DDP(Policy(od, ad).to(dev), device_ids=[local_rank])
    disc = DDP(Discriminator(od, ad).to(dev), device_ids=[local_rank])
    p_opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    d_opt = torch.optim.Adam(disc.parameters(), lr=args.disc_lr)

    T, N = args.num_steps, args.num_envs
    obs_b = torch.zeros(T, N, od, device=dev)
    act_b = torch.zeros(T, N, ad, device=dev)
    logp_b = torch.zeros(T, N, device=dev)
    val_b = torch.zeros(T, N, device=dev)
    done_b = torch.zeros(T, N, device=dev)
    true_returns = []

    obs, _ = envs.reset(seed=[1000 * rank + i for i in range(N)])
    obs = torch.as_tensor(obs, dtype=torch.float32, device=dev)
    done = torch.zeros(N, device=dev)
    t0 = time.time()

    for it in range(args.iters):
        # ---------------- rollout
        for t in range(T):
            with torch.no_grad():
                a, lp, _, v = policy(obs)
            obs_b[t], act_b[t], logp_b[t], val_b[t], done_b[t] = obs, a, lp, v, done
            nobs, _, term, trunc, info = envs.step(a.cpu().numpy())
            if "final_info" in info:
                for fi in info["final_info"]:
                    if fi is not None and "episode" in fi:
                        true_returns.append(float(fi["episode"]["r"]))
            obs = torch.as_tensor(nobs, dtype=torch.float32, device=dev)
            done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=dev)

        flat_obs = obs_b.reshape(-1, od)
        flat_act = act_b.reshape(-1, ad)

        # ---------------- discriminator
        disc.train()
        for _ in range(args.disc_steps):
            pi_idx = torch.randint(0, flat_obs.shape[0], (args.disc_batch,), device=dev)
            ex_idx = torch.randint(0, exp_obs.shape[0], (args.disc_batch,), device=dev)
            d_exp = disc(exp_obs[ex_idx], exp_act[ex_idx])
            d_pi = disc(flat_obs[pi_idx], flat_act[pi_idx])
            d_loss = F.binary_cross_entropy_with_logits(d_exp, torch.ones_like(d_exp)) + \
                F.binary_cross_entropy_with_logits(d_pi, torch.zeros_like(d_pi))
            d_opt.zero_grad()
            d_loss.backward()
            d_opt.step()

        # ---------------- imitation reward + GAE
        disc.eval()
        with torch.no_grad():
            rew = -F.logsigmoid(-disc.module(flat_obs, flat_act)).view(T, N)
            next_v = policy.module(obs)[3]
            adv = torch.zeros(T, N, device=dev)
            gae = torch.zeros(N, device=dev)
            for t in reversed(range(T)):
                nv = next_v if t == T - 1 else val_b[t + 1]
                nd = done if t == T - 1 else done_b[t + 1]
                delta = rew[t] + args.gamma * nv * (1 - nd) - val_b[t]
                gae = delta + args.gamma * args.lam * (1 - nd) * gae
                adv[t] = gae
            ret = adv + val_b

        # ---------------- PPO
        b_adv = adv.reshape(-1)
        b_ret, b_logp = ret.reshape(-1), logp_b.reshape(-1)
        bs = T * N
        mb = bs // args.minibatches
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(bs, device=dev)
            for s in range(0, bs, mb):
                i = perm[s:s + mb]
                _, lp, ent, v = policy(flat_obs[i], flat_act[i])
                a_n = (b_adv[i] - b_adv[i].mean()) / (b_adv[i].std() + 1e-8)
                ratio = (lp - b_logp[i]).exp()
                pg = -torch.min(ratio * a_n, ratio.clamp(1 - args.clip, 1 + args.clip) * a_n).mean()
                vl = 0.5 * (v - b_ret[i]).pow(2).mean()
                loss = pg + 0.5 * vl - 0.0 * ent.mean()
                p_opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
                p_opt.step()

        if it % 10 == 0:
            s = torch.tensor([sum(true_returns[-20:]), len(true_returns[-20:]), d_loss.item()], device=dev)
            dist.all_reduce(s)
            if rank == 0:
                print(f"it {it} env return {(s[0] / s[1].clamp(min=1)).item():.1f} d_loss {s[2].item() / world:.3f} "
                      f"time {time.time() - t0:.0f}s", flush=True)
        if rank == 0 and (it % 100 == 0 or it == args.iters - 1):
            os.makedirs(args.out, exist_ok=True)
            torch.save({"policy": policy.module.state_dict(), "disc": disc.module.state_dict(), "it": it},
                       os.path.join(args.out, f"gail_{it}.pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
