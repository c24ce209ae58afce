"""SAC with automatic entropy tuning, multi-GPU (one learner + env workers per GPU).

Layout per rank:
  * AsyncVectorEnv with `num_envs` MuJoCo envs (spawned subprocesses)
  * a local replay buffer
  * actor / critic / temperature, each in its own DDP wrapper

    torchrun --nproc_per_node=8 11_sac_twin_critic.py --env-id Humanoid-v4 --utd 2
"""
import argparse
import functools
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="Humanoid-v4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--total-env-steps", type=int, default=3_000_000, help="per rank")
    p.add_argument("--start-steps", type=int, default=10_000)
    p.add_argument("--buffer-size", type=int, default=500_000)
    p.add_argument("--batch-size", type=int, default=2048, help="global; each rank samples batch_size / world")
    p.add_argument("--utd", type=int, default=1, help="gradient updates per env step")
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=20_000)
    p.add_argument("--eval-episodes", type=int, default=2, help="per rank")
    p.add_argument("--ckpt", default="checkpoints/sac.pt")
    p.add_argument("--project", default="dist-sac")
    return p.parse_args()


def make_env(env_id, seed):
    env = gym.make(env_id)
    env = gym.wrappers.RecordEpisodeStatistics(env)
    env.action_space.seed(seed)
    return env


def mlp(inp, out, hidden):
    return nn.Sequential(nn.Linear(inp, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, out))


class Critic(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden):
        super().__init__()
        self.q1 = mlp(obs_dim + act_dim, 1, hidden)
        self.q2 = mlp(obs_dim + act_dim, 1, hidden)

    def forward(self, o, a):
        x = torch.cat([o, a], -1)
        return self.q1(x), self.q2(x)


class Actor(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden, act_scale):
        super().__init__()
        self.trunk = mlp(obs_dim, 2 * act_dim, hidden)
        self.register_buffer("act_scale", torch.as_tensor(act_scale, dtype=torch.float32))

    def forward(self, o, deterministic=False):
        mu, log_std = self.trunk(o).chunk(2, -1)
        log_std = log_std.clamp(-20, 2)
        std = log_std.exp()
        u = mu if deterministic else mu + std * torch.randn_like(mu)
        a = torch.tanh(u)
        logp = (-0.5 * ((u - mu) / std) ** 2 - log_std - 0.5 * np.log(2 * np.pi)).sum(-1, keepdim=True)
        logp = logp - (2 * (np.log(2) - u - F.softplus(-2 * u))).sum(-1, keepdim=True)
        return a * self.act_scale, logp


class Temperature(nn.Module):
    def __init__(self, target_entropy, init=1.0):
        super().__init__()
        self.target_entropy = target_entropy
        self.log_alpha = nn.Parameter(torch.tensor(np.log(init), dtype=torch.float32))

    def alpha(self):
        return self.log_alpha.exp()

    def forward(self, logp):
        # temperature loss; logp comes in detached
        return -(self.log_alpha.exp() * (logp + self.target_entropy)).mean()


class Replay:
    def __init__(self, n, od, ad):
        self.o = np.empty((n, od), np.float32)
        self.a = np.empty((n, ad), np.float32)
        self.r = np.empty((n, 1), np.float32)
        self.o2 = np.empty((n, od), np.float32)
        self.d = np.empty((n, 1), np.float32)
        self.n, self.i, self.full = n, 0, False

    def add(self, o, a, r, o2, d):
        k = len(o)
        idx = (np.arange(k) + self.i) % self.n
        self.o[idx], self.a[idx], self.r[idx, 0], self.o2[idx], self.d[idx, 0] = o, a, r, o2, d
        self.full = self.full or self.i + k >= self.n
        self.i = (self.i + k) % self.n

    def sample(self, bs, device):
        hi = self.n if self.full else self.i
        j = np.random.randint(0, hi, bs)
        return [torch.from_numpy(x[j]).to(device, non_blocking=True) for x in (self.o, self.a, self.r, self.o2, self.d)]


@torch.no_grad()
def evaluate(actor, env_id, episodes, seed, device):
    env = make_env(env_id, seed)
    total = 0.0
    for ep in range(episodes):
        o, _ = env.reset(seed=seed + ep)
        done = False
        while not done:
            a, _ = actor(torch.as_tensor(o, dtype=torch.float32, device=device)[None], deterministic=True)
            o, r, term, trunc, _ = env.step(a[0].cpu().numpy())
            total += r
            done = term or trunc
    env.close()
    return total


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    local_batch = args.batch_size // world
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    # only rank 0 talks to the wandb server, the other ranks get a no-op run object
    run = wandb.init(project=args.project, config={**vars(args), "world_size": world},
                     mode="online" if rank == 0 else "disabled")

    env_fns = [functools.partial(make_env, args.env_id, args.seed + 1000 * rank + i) for i in range(args.num_envs)]
    envs = gym.vector.AsyncVectorEnv(env_fns, context="spawn")
    od = envs.single_observation_space.shape[0]
    ad = envs.single_action_space.shape[0]
    act_scale = envs.single_action_space.high

    actor = DDP(Actor(od, ad, args.hidden, act_scale).to(dev), device_ids=[local_rank])
    critic = DDP(Critic(od, ad, args.hidden).to(dev), device_ids=[local_rank])
    temp = DDP(Temperature(target_entropy=-float(ad)).to(dev), device_ids=[local_rank])
    critic_targ = Critic(od, ad, args.hidden).to(dev)
    critic_targ.load_state_dict(critic.module.state_dict())
    critic_targ.requires_grad_(False)

    opt_pi = torch.optim.Adam(actor.parameters(), lr=args.lr)
    opt_q = torch.optim.Adam(critic.parameters(), lr=args.lr)
    opt_t = torch.optim.Adam(temp.parameters(), lr=args.lr)

    start = 0
    if os.path.isfile(args.ckpt):
        ck = torch.load(args.ckpt, map_location=dev)
        actor.module.load_state_dict(ck["actor"])
        critic.module.load_state_dict(ck["critic"])
        critic_targ.load_state_dict(ck["critic_targ"])
        temp.module.load_state_dict(ck["temp"])
        for o, k in ((opt_pi, "opt_pi"), (opt_q, "opt_q"), (opt_t, "opt_t")):
            o.load_state_dict(ck[k])
        start = ck["env_steps"]
        if rank == 0:
            print(f"resumed from {args.ckpt} at {start} env steps/rank")

    buf = Replay(args.buffer_size, od, ad)
    obs, _ = envs.reset(seed=args.seed + 1000 * rank)
    tic = time.time()
    for t in range(start, args.total_env_steps, args.num_envs):
        if t < start + args.start_steps:
            act = envs.action_space.sample()
        else:
            with torch.no_grad():
                act, _ = actor.module(torch.as_tensor(obs, dtype=torch.float32, device=dev))
            act = act.cpu().numpy()
        obs2, rew, term, trunc, info = envs.step(act)
        nxt = obs2.copy()
        if "final_observation" in info:
            for i in np.nonzero(info["_final_observation"])[0]:
                nxt[i] = info["final_observation"][i]
        buf.add(obs, act, rew, nxt, term.astype(np.float32))
        obs = obs2
        if t < start + args.start_steps:
            continue

        for _ in range(args.utd):
            o, a, r, o2, d = buf.sample(local_batch, dev)
            alpha = temp.module.alpha().detach()
            with torch.no_grad():
                a2, logp2 = actor.module(o2)
                q1t, q2t = critic_targ(o2, a2)
                y = r + args.gamma * (1 - d) * (torch.min(q1t, q2t) - alpha * logp2)
            q1, q2 = critic(o, a)
            loss_q = F.mse_loss(q1, y) + F.mse_loss(q2, y)
            opt_q.zero_grad(set_to_none=True)
            loss_q.backward()
            opt_q.step()

            critic.requires_grad_(False)
            pi, logp = actor(o)
            q1p, q2p = critic.module(o, pi)
            loss_pi = (alpha * logp - torch.min(q1p, q2p)).mean()
            opt_pi.zero_grad(set_to_none=True)
            loss_pi.backward()
            opt_pi.step()
            critic.requires_grad_(True)

            loss_t = temp(logp.detach())
            opt_t.zero_grad(set_to_none=True)
            loss_t.backward()
            opt_t.step()

            with torch.no_grad():
                for p, pt in zip(critic.module.parameters(), critic_targ.parameters()):
                    pt.lerp_(p, args.tau)

        if (t // args.num_envs) % (args.eval_every // args.num_envs) == 0:
            ret = evaluate(actor.module, args.env_id, args.eval_episodes, 10_000 + 100 * rank, dev)
            stats = torch.tensor([ret, args.eval_episodes, loss_q.item(), loss_pi.item()], device=dev)
            dist.all_reduce(stats)
            eval_return = (stats[0] / stats[1]).item()
            if rank == 0:
                sps = (t - start) * world / (time.time() - tic)
                print(f"t={t * world} eval_return={eval_return:.1f} alpha={alpha.item():.3f} sps={sps:.0f}")
                run.log({"eval/return": eval_return, "loss/q": stats[2].item() / world,
                         "loss/pi": stats[3].item() / world, "alpha": alpha.item(), "sps": sps},
                        step=t * world)
                os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
                tmp = args.ckpt + ".tmp"
                torch.save({"actor": actor.module.state_dict(), "critic": critic.module.state_dict(),
                            "critic_targ": critic_targ.state_dict(), "temp": temp.module.state_dict(),
                            "opt_pi": opt_pi.state_dict(), "opt_q": opt_q.state_dict(),
                            "opt_t": opt_t.state_dict(), "env_steps": t + args.num_envs}, tmp)
                os.replace(tmp, args.ckpt)
            dist.barrier()

    envs.close()
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
