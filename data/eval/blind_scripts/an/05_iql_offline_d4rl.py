"""Implicit Q-Learning on D4RL, data-parallel over GPUs.

Every rank keeps the full offline replay buffer in GPU memory and samples its own
minibatches from it; gradients are averaged by DDP.

    torchrun --nproc_per_node=4 05_iql_offline_d4rl.py --env antmaze-large-diverse-v2
"""
import argparse
import copy
import os
import time

import d4rl  # noqa: F401
import gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="antmaze-large-diverse-v2")
    p.add_argument("--max_steps", type=int, default=1_000_000)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--discount", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--expectile", type=float, default=0.9)
    p.add_argument("--beta", type=float, default=10.0)
    p.add_argument("--eval_every", type=int, default=50_000)
    p.add_argument("--eval_episodes", type=int, default=100)
    p.add_argument("--log_every", type=int, default=5000)
    p.add_argument("--save_dir", default="checkpoints/iql")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ReplayBuffer:
    def __init__(self, data, device, generator):
        self.obs = torch.as_tensor(data["observations"], dtype=torch.float32, device=device)
        self.act = torch.as_tensor(data["actions"], dtype=torch.float32, device=device)
        self.rew = torch.as_tensor(data["rewards"], dtype=torch.float32, device=device)
        self.next_obs = torch.as_tensor(data["next_observations"], dtype=torch.float32, device=device)
        self.done = torch.as_tensor(data["terminals"], dtype=torch.float32, device=device)
        self.size = self.obs.shape[0]
        self.gen = generator

    def sample(self, n):
        idx = torch.randint(0, self.size, (n,), device=self.obs.device, generator=self.gen)
        return self.obs[idx], self.act[idx], self.rew[idx], self.next_obs[idx], self.done[idx]


def mlp(i, o, h=256, n=2, out_act=None):
    layers, d = [], i
    for _ in range(n):
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    layers.append(nn.Linear(d, o))
    if out_act is not None:
        layers.append(out_act)
    return nn.Sequential(*layers)


class TwinQ(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.q1 = mlp(obs_dim + act_dim, 1)
        self.q2 = mlp(obs_dim + act_dim, 1)

    def forward(self, s, a):
        x = torch.cat([s, a], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class GaussianPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.net = mlp(obs_dim, act_dim, out_act=nn.Tanh())
        self.log_std = nn.Parameter(torch.zeros(act_dim))

    def forward(self, s, a):
        dist_ = torch.distributions.Normal(self.net(s), self.log_std.clamp(-5.0, 2.0).exp())
        return dist_.log_prob(a).sum(-1)

    @torch.no_grad()
    def act(self, s):
        return self.net(s)


def preprocess(dataset, env_name):
    if "antmaze" in env_name:
        dataset["rewards"] = dataset["rewards"] - 1.0
    return dataset


def evaluate(policy, env, n, seed, device):
    returns = []
    for i in range(n):
        env.seed(seed + i)
        obs, done, ret = env.reset(), False, 0.0
        while not done:
            a = policy.act(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])[0].cpu().numpy()
            obs, r, done, _ = env.step(a)
            ret += r
        returns.append(ret)
    return returns


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    env = gym.make(args.env)
    data = preprocess(d4rl.qlearning_dataset(env), args.env)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1000 + rank)
    buffer = ReplayBuffer(data, device, gen)
    obs_dim, act_dim = buffer.obs.shape[1], buffer.act.shape[1]

    qf = TwinQ(obs_dim, act_dim).to(device)
    q_target = copy.deepcopy(qf).requires_grad_(False)
    vf = mlp(obs_dim, 1).to(device)
    policy = GaussianPolicy(obs_dim, act_dim).to(device)

    qf = DDP(qf, device_ids=[local_rank])
    vf = DDP(vf, device_ids=[local_rank])
    policy = DDP(policy, device_ids=[local_rank])

    q_opt = torch.optim.Adam(qf.parameters(), lr=args.lr)
    v_opt = torch.optim.Adam(vf.parameters(), lr=args.lr)
    pi_opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    pi_sched = torch.optim.lr_scheduler.CosineAnnealingLR(pi_opt, args.max_steps)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        wandb.init(project="iql-ddp", name=f"{args.env}-s{args.seed}", config=vars(args))

    acc = torch.zeros(4, device=device)
    t0 = time.time()
    for step in range(1, args.max_steps + 1):
        s, a, r, s2, d = buffer.sample(args.batch_size)

        # value: expectile regression towards min target Q
        with torch.no_grad():
            tq = torch.min(*q_target(s, a))
        v = vf(s).squeeze(-1)
        diff = tq - v
        w = torch.where(diff > 0, args.expectile, 1 - args.expectile)
        v_loss = (w * diff.pow(2)).mean()
        v_opt.zero_grad(set_to_none=True)
        v_loss.backward()
        v_opt.step()

        # Q: TD towards r + gamma * V(s')
        with torch.no_grad():
            target = r + args.discount * (1.0 - d) * vf.module(s2).squeeze(-1)
        q1, q2 = qf(s, a)
        q_loss = 0.5 * (F.mse_loss(q1, target) + F.mse_loss(q2, target))
        q_opt.zero_grad(set_to_none=True)
        q_loss.backward()
        q_opt.step()

        with torch.no_grad():
            for p, tp in zip(qf.module.parameters(), q_target.parameters()):
                tp.mul_(1 - args.tau).add_(p, alpha=args.tau)

        # policy: advantage weighted regression
        with torch.no_grad():
            adv = tq - v.detach()
            exp_adv = torch.exp(args.beta * adv).clamp(max=100.0)
        bc_loss = -policy(s, a)
        pi_loss = (exp_adv * bc_loss).mean()
        pi_opt.zero_grad(set_to_none=True)
        pi_loss.backward()
        pi_opt.step()
        pi_sched.step()

        acc += torch.stack([v_loss.detach(), q_loss.detach(), pi_loss.detach(), torch.ones((), device=device)])

        if step % args.log_every == 0:
            dist.all_reduce(acc)
            if rank == 0:
                wandb.log({"loss/v": (acc[0] / acc[3]).item(), "loss/q": (acc[1] / acc[3]).item(),
                           "loss/pi": (acc[2] / acc[3]).item(), "sps": args.log_every / (time.time() - t0)},
                          step=step)
            acc.zero_()
            t0 = time.time()

        if step % args.eval_every == 0:
            n_local = args.eval_episodes // world + int(rank < args.eval_episodes % world)
            rets = evaluate(policy.module, env, n_local, seed=args.seed * 100_000 + rank * 1000, device=device)
            totals = torch.tensor([sum(env.get_normalized_score(x) * 100 for x in rets), len(rets)],
                                  dtype=torch.float64)
            dist.all_reduce(totals)
            if rank == 0:
                score = (totals[0] / totals[1]).item()
                wandb.log({"eval/normalized_score": score}, step=step)
                print(f"step {step}: d4rl score {score:.1f}")
                torch.save({"qf": qf.module.state_dict(), "q_target": q_target.state_dict(),
                            "vf": vf.module.state_dict(), "policy": policy.module.state_dict(), "step": step},
                           os.path.join(args.save_dir, f"iql_{args.env}_{step}.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
