"""Asynchronous actor-learner (APPO flavour) for BipedalWalker / continuous control.

torchrun starts one learner per GPU. Each learner spawns CPU actor processes that
collect fixed-length trajectories with a (possibly stale) copy of the policy and
push them to the learner through a queue. Policy-lag is corrected with truncated
importance weights (V-trace) and the PPO clipped objective.

    torchrun --nproc_per_node=4 impala_async_actors.py --env-id BipedalWalker-v3 --actors 16
"""
import argparse
import os
import queue
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="BipedalWalker-v3")
    p.add_argument("--actors", type=int, default=16, help="actor processes per learner")
    p.add_argument("--traj-len", type=int, default=128)
    p.add_argument("--batch-trajs", type=int, default=32)
    p.add_argument("--updates", type=int, default=50_000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--ent-coef", type=float, default=1e-3)
    p.add_argument("--publish-every", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-dir", default="ckpt/appo_bipedal")
    return p.parse_args()


def make_env(env_id, seed):
    env = gym.make(env_id)
    env = gym.wrappers.ClipAction(env)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


class Actor(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                nn.Linear(256, act_dim))
        self.v = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                               nn.Linear(256, 1))
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.7))

    def forward(self, obs):
        return Normal(self.mu(obs), self.log_std.exp()), self.v(obs).squeeze(-1)


def actor_worker(actor_id, env_fn, seed, shared_policy, version, traj_len, out_q, stop):
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    env = env_fn()
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    policy = Actor(obs_dim, act_dim)
    local_version = -1
    obs, _ = env.reset()
    ep_ret = 0.0
    while not stop.is_set():
        if version.value != local_version:
            local_version = version.value
            policy.load_state_dict(shared_policy.state_dict())
        o_buf = np.zeros((traj_len + 1, obs_dim), np.float32)
        a_buf = np.zeros((traj_len, act_dim), np.float32)
        lp_buf = np.zeros(traj_len, np.float32)
        r_buf = np.zeros(traj_len, np.float32)
        d_buf = np.zeros(traj_len, np.float32)
        returns = []
        for t in range(traj_len):
            o_buf[t] = obs
            with torch.no_grad():
                d, _ = policy(torch.from_numpy(o_buf[t]).unsqueeze(0))
                a = d.sample()[0]
            a_buf[t], lp_buf[t] = a.numpy(), d.log_prob(a).sum().item()
            obs, r, term, trunc, _ = env.step(a.numpy())
            ep_ret += r
            r_buf[t], d_buf[t] = r, float(term)
            if term or trunc:
                returns.append(ep_ret)
                ep_ret = 0.0
                obs, _ = env.reset()
                if trunc and not term:
                    d_buf[t] = 1.0  # treat time-outs as terminal for simplicity
        o_buf[traj_len] = obs
        try:
            out_q.put((o_buf, a_buf, lp_buf, r_buf, d_buf, returns, local_version), timeout=5.0)
        except queue.Full:
            pass
    env.close()


@torch.no_grad()
def vtrace(log_rho, rew, done, values, gamma):
    rho = log_rho.exp().clamp(max=1.0)
    disc = gamma * (1.0 - done)
    vs = torch.zeros_like(values)
    acc = torch.zeros_like(values[-1])
    for t in reversed(range(rew.shape[0])):
        delta = rho[t] * (rew[t] + disc[t] * values[t + 1] - values[t])
        acc = delta + disc[t] * rho[t] * acc
        vs[t] = acc + values[t]
    vs[-1] = values[-1]
    adv = rho * (rew + disc * vs[1:] - values[:-1])
    return vs[:-1], adv


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    probe = gym.make(args.env_id)
    obs_dim, act_dim = probe.observation_space.shape[0], probe.action_space.shape[0]
    probe.close()

    torch.manual_seed(args.seed)
    learner = DDP(Actor(obs_dim, act_dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(learner.parameters(), lr=args.lr)

    shared_policy = Actor(obs_dim, act_dim)
    shared_policy.load_state_dict(learner.module.state_dict())
    shared_policy.share_memory()

    ctx = mp.get_context("spawn")
    version = ctx.Value("i", 0)
    stop = ctx.Event()
    traj_q = ctx.Queue(maxsize=4 * args.batch_trajs)
    env_fns = [lambda i=i: make_env(args.env_id, args.seed * 100_000 + rank * 1000 + i) for i in range(args.actors)]
    procs = []
    for i in range(args.actors):
        pr = ctx.Process(target=actor_worker,
                         args=(i, env_fns[i], args.seed * 100_000 + rank * 1000 + i, shared_policy, version,
                               args.traj_len, traj_q, stop), daemon=True)
        pr.start()
        procs.append(pr)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    ret_window, lag_window = [], []
    t0 = time.time()
    for update in range(1, args.updates + 1):
        trajs = [traj_q.get() for _ in range(args.batch_trajs)]
        o, a, blp, r, d = (torch.from_numpy(np.stack([tr[k] for tr in trajs], axis=1)).to(device)
                           for k in range(5))
        for tr in trajs:
            ret_window.extend(tr[5])
            lag_window.append(version.value - tr[6])

        T, B = a.shape[:2]
        dist_, values = learner(o.flatten(0, 1))
        values = values.view(T + 1, B)
        mu = dist_.mean.view(T + 1, B, -1)[:-1]
        std = dist_.stddev.view(T + 1, B, -1)[:-1]
        pi = Normal(mu, std)
        logp = pi.log_prob(a).sum(-1)
        vs, adv = vtrace(logp.detach() - blp, r, d, values.detach(), args.gamma)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        ratio = (logp - blp).exp()
        pg = -torch.min(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv).mean()
        vl = 0.5 * (values[:-1] - vs).pow(2).mean()
        ent = pi.entropy().sum(-1).mean()
        loss = pg + args.vf_coef * vl - args.ent_coef * ent

        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(learner.parameters(), 1.0)
        opt.step()

        if update % args.publish_every == 0:
            shared_policy.load_state_dict(learner.module.state_dict())
            with version.get_lock():
                version.value += 1

        if update % 100 == 0:
            s = torch.tensor([sum(ret_window), len(ret_window), sum(lag_window), len(lag_window)],
                             dtype=torch.float64, device=device)
            dist.all_reduce(s)
            ret_window.clear()
            lag_window.clear()
            if rank == 0:
                sps = update * T * B * world / (time.time() - t0)
                print(f"update {update} sps {sps:.0f} return {(s[0] / s[1].clamp(min=1)).item():.1f} "
                      f"policy_lag {(s[2] / s[3]).item():.2f} pg {pg.item():.3f} vl {vl.item():.3f}", flush=True)
            if rank == 0 and update % 1000 == 0:
                torch.save({"policy": learner.module.state_dict(), "opt": opt.state_dict(), "update": update},
                           os.path.join(args.ckpt_dir, f"policy_{update:07d}.pt"))

    stop.set()
    for pr in procs:
        pr.join(timeout=10)
        if pr.is_alive():
            pr.terminate()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
