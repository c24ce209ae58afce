"""Long-running PPO on Humanoid-v4 with preemption-safe checkpoints.

The cluster preempts jobs every few hours, so the job always resumes from
<run_dir>/latest.pt when it exists. Run from the shared filesystem:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 \
        ppo_humanoid.py --run-dir /shared/rl/humanoid_ppo_v7
"""
import argparse
import os
import signal
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

STOP = False


def _on_sigterm(signum, frame):
    global STOP
    STOP = True


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--env-id", default="Humanoid-v4")
    p.add_argument("--envs-per-rank", type=int, default=32)
    p.add_argument("--horizon", type=int, default=128)
    p.add_argument("--total-steps", type=int, default=1_000_000_000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--minibatch-size", type=int, default=2048)
    p.add_argument("--gamma", type=float, default=0.995)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=1.0)
    p.add_argument("--ent-coef", type=float, default=1e-3)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=5)
    return p.parse_args()


class Policy(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(obs_dim, 512), nn.ELU(), nn.Linear(512, 256), nn.ELU(), nn.Linear(256, act_dim))
        self.vf = nn.Sequential(nn.Linear(obs_dim, 512), nn.ELU(), nn.Linear(512, 256), nn.ELU(), nn.Linear(256, 1))
        self.log_std = nn.Parameter(torch.full((act_dim,), -1.0))

    def forward(self, obs, act=None):
        mu = self.pi(obs)
        d = torch.distributions.Normal(mu, self.log_std.exp())
        if act is None:
            act = d.sample()
        return act, d.log_prob(act).sum(-1), d.entropy().sum(-1), self.vf(obs).squeeze(-1)


class ObsNorm(nn.Module):
    """Running observation normaliser kept identical on all ranks (stats are all-reduced)."""

    def __init__(self, dim):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(1e-4))

    @torch.no_grad()
    def update(self, x):
        s = torch.cat([x.sum(0), (x ** 2).sum(0), x.new_tensor([x.shape[0]])])
        dist.all_reduce(s)
        d = x.shape[1]
        n = s[-1]
        m = s[:d] / n
        v = s[d:2 * d] / n - m ** 2
        delta = m - self.mean
        tot = self.count + n
        self.mean += delta * n / tot
        self.var.copy_((self.var * self.count + v * n + delta ** 2 * self.count * n / tot) / tot)
        self.count.copy_(tot)

    def forward(self, x):
        return ((x - self.mean) / (self.var + 1e-8).sqrt()).clamp(-5, 5)


def save_ckpt(path, policy, obs_norm, opt, it, steps):
    tmp = path + ".tmp"
    torch.save({"policy": policy.state_dict(), "obs_norm": obs_norm.state_dict(), "opt": opt.state_dict(),
                "iteration": it, "env_steps": steps}, tmp)
    os.replace(tmp, path)


def main():
    args = parse()
    signal.signal(signal.SIGTERM, _on_sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    ckpt_path = os.path.join(args.run_dir, "latest.pt")

    envs = gym.vector.SyncVectorEnv([lambda: gym.make(args.env_id) for _ in range(args.envs_per_rank)])
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]

    torch.manual_seed(args.seed)
    policy = Policy(obs_dim, act_dim).to(dev)
    obs_norm = ObsNorm(obs_dim).to(dev)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)

    start_it, env_steps = 0, 0
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path)
        policy.load_state_dict(state["policy"])
        obs_norm.load_state_dict(state["obs_norm"])
        opt.load_state_dict(state["opt"])
        start_it, env_steps = state["iteration"], state["env_steps"]
        if rank == 0:
            print(f"resumed from {ckpt_path} at iteration {start_it} ({env_steps} env steps)", flush=True)
    model = DDP(policy, device_ids=[local_rank])
    torch.manual_seed(args.seed + 1 + rank + start_it)
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    T, N = args.horizon, args.envs_per_rank
    total_its = args.total_steps // (T * N * world)
    obs_np, _ = envs.reset(seed=args.seed * 10_000 + start_it * 97 + rank * N)
    ep_ret, ep_len = np.zeros(N), np.zeros(N)
    finished = []
    tic = time.time()

    for it in range(start_it, total_its):
        raw = torch.zeros(T, N, obs_dim, device=dev)
        acts = torch.zeros(T, N, act_dim, device=dev)
        logps = torch.zeros(T, N, device=dev)
        vals = torch.zeros(T, N, device=dev)
        rews = torch.zeros(T, N, device=dev)
        terms = torch.zeros(T, N, device=dev)
        for t in range(T):
            o = torch.as_tensor(obs_np, dtype=torch.float32, device=dev)
            with torch.no_grad():
                a, lp, _, v = policy(obs_norm(o))
            obs_np, r, term, trunc, _ = envs.step(a.cpu().numpy())
            raw[t], acts[t], logps[t], vals[t] = o, a, lp, v
            rews[t] = torch.as_tensor(r, dtype=torch.float32, device=dev)
            terms[t] = torch.as_tensor(term | trunc, dtype=torch.float32, device=dev)
            ep_ret += r
            ep_len += 1
            for i in np.flatnonzero(term | trunc):
                finished.append((ep_ret[i], ep_len[i]))
                ep_ret[i], ep_len[i] = 0.0, 0
        env_steps += T * N * world

        with torch.no_grad():
            _, _, _, last_v = policy(obs_norm(torch.as_tensor(obs_np, dtype=torch.float32, device=dev)))
            adv = torch.zeros_like(rews)
            g = torch.zeros(N, device=dev)
            for t in reversed(range(T)):
                nv = last_v if t == T - 1 else vals[t + 1]
                nt = 1.0 - terms[t]
                g = rews[t] + args.gamma * nv * nt - vals[t] + args.gamma * args.lam * nt * g
                adv[t] = g
            ret = adv + vals
            b_obs = obs_norm(raw.view(T * N, obs_dim))
        obs_norm.update(raw.view(T * N, obs_dim))

        b_act, b_logp, b_adv, b_ret = acts.view(T * N, act_dim), logps.view(-1), adv.view(-1), ret.view(-1)
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        for _ in range(args.epochs):
            perm = torch.randperm(T * N, device=dev)
            for s in range(0, T * N, args.minibatch_size):
                idx = perm[s:s + args.minibatch_size]
                _, nlp, ent, v = model(b_obs[idx], b_act[idx])
                ratio = (nlp - b_logp[idx]).exp()
                pg = -torch.min(ratio * b_adv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * b_adv[idx]).mean()
                vl = (v - b_ret[idx]).pow(2).mean()
                loss = pg + args.vf_coef * vl - args.ent_coef * ent.mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

        stat = torch.tensor([sum(f[0] for f in finished), sum(f[1] for f in finished), len(finished)],
                            dtype=torch.float64, device=dev)
        dist.all_reduce(stat)
        finished.clear()
        if rank == 0 and it % 10 == 0:
            n = max(stat[2].item(), 1)
            print(f"it {it}/{total_its} steps {env_steps} ret {stat[0].item() / n:.1f} len {stat[1].item() / n:.0f} "
                  f"pg {pg.item():.4f} vl {vl.item():.3f} sps {(env_steps) / (time.time() - tic):.0f}", flush=True)

        stop = torch.tensor([float(STOP)], device=dev)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if (it + 1) % args.ckpt_every == 0 or stop.item() > 0:
            if rank == 0:
                save_ckpt(ckpt_path, policy, obs_norm, opt, it + 1, env_steps)
            dist.barrier()
        if stop.item() > 0:
            break

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
