"""PPO for the Franka Panda manipulation suite (panda-gym), DDP across GPUs.

Goal-conditioned observations are flattened ([observation, achieved_goal, desired_goal]).
Checkpoints are rotated (keep the last K) in --ckpt-dir on the shared NFS.

    torchrun --nproc_per_node=8 ppo_robot_arm.py --env-id PandaPushDense-v3 --ckpt-dir /nfs/rl/panda_push
"""
import argparse
import glob
import os
import re
import time

import gymnasium as gym
import numpy as np
import panda_gym  # noqa: F401
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-id", default="PandaPushDense-v3")
    ap.add_argument("--n-envs", type=int, default=32)
    ap.add_argument("--n-steps", type=int, default=100)
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gamma", type=float, default=0.98)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--mb-size", type=int, default=800)
    ap.add_argument("--ent-coef", type=float, default=0.0)
    ap.add_argument("--vf-coef", type=float, default=0.5)
    ap.add_argument("--ckpt-dir", default="/nfs/rl/panda_push")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--keep", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def make_env(env_id, seed):
    def _f():
        env = gym.make(env_id)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env
    return _f


class ArmPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, 256), nn.LayerNorm(256), nn.Tanh(),
                                  nn.Linear(256, 256), nn.Tanh())
        self.mu = nn.Linear(256, act_dim)
        self.log_std = nn.Parameter(torch.zeros(act_dim) - 0.5)
        self.v = nn.Sequential(nn.Linear(obs_dim, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))

    def forward(self, obs, act=None):
        d = Normal(torch.tanh(self.mu(self.body(obs))), self.log_std.exp())
        if act is None:
            act = d.sample()
        return act, d.log_prob(act).sum(-1), d.entropy().sum(-1), self.v(obs).squeeze(-1)


class CheckpointManager:
    def __init__(self, directory, keep):
        self.dir, self.keep = directory, keep
        os.makedirs(directory, exist_ok=True)

    def latest(self):
        files = sorted(glob.glob(os.path.join(self.dir, "ckpt_*.pt")),
                       key=lambda f: int(re.findall(r"ckpt_(\d+)\.pt", f)[0]))
        return files[-1] if files else None

    def save(self, it, model, optimizer, extra=None):
        path = os.path.join(self.dir, f"ckpt_{it:06d}.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": it,
                    **(extra or {})}, path)
        files = sorted(glob.glob(os.path.join(self.dir, "ckpt_*.pt")))
        for old in files[:-self.keep]:
            os.remove(old)
        return path


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, args.seed + 1000 * rank + i) for i in range(args.n_envs)])
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]

    torch.manual_seed(args.seed)
    policy = ArmPolicy(obs_dim, act_dim).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    ckpts = CheckpointManager(args.ckpt_dir, args.keep)
    start_it = 0
    last = ckpts.latest()
    if last is not None:
        state = torch.load(last, map_location=device)
        policy.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_it = state["iteration"]
    dist.barrier()
    model = DDP(policy, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank + start_it)
    writer = SummaryWriter(os.path.join(args.ckpt_dir, "tb")) if rank == 0 else None

    T, N = args.n_steps, args.n_envs
    obs_np, _ = envs.reset(seed=args.seed + 1000 * rank + start_it)
    tic = time.time()
    for it in range(start_it, args.iterations):
        obs_t = torch.zeros(T, N, obs_dim, device=device)
        act_t = torch.zeros(T, N, act_dim, device=device)
        logp_t = torch.zeros(T, N, device=device)
        val_t = torch.zeros(T, N, device=device)
        rew_t = torch.zeros(T, N, device=device)
        term_t = torch.zeros(T, N, device=device)
        ep_stats = torch.zeros(3, device=device)  # return sum, success count, episodes
        for t in range(T):
            o = torch.as_tensor(obs_np, dtype=torch.float32, device=device)
            with torch.no_grad():
                a, lp, _, v = policy(o)
            obs_np, r, term, trunc, info = envs.step(a.clamp(-1, 1).cpu().numpy())
            obs_t[t], act_t[t], logp_t[t], val_t[t] = o, a, lp, v
            rew_t[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            term_t[t] = torch.as_tensor(term | trunc, dtype=torch.float32, device=device)
            if "final_info" in info:
                for fi in info["final_info"]:
                    if fi is not None and "episode" in fi:
                        ep_stats += torch.tensor([float(fi["episode"]["r"]), float(fi.get("is_success", 0.0)), 1.0],
                                                 device=device)

        with torch.no_grad():
            _, _, _, last_v = policy(torch.as_tensor(obs_np, dtype=torch.float32, device=device))
            adv = torch.zeros_like(rew_t)
            gae = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nv = last_v if t == T - 1 else val_t[t + 1]
                nt = 1.0 - term_t[t]
                gae = rew_t[t] + args.gamma * nv * nt - val_t[t] + args.gamma * args.lam * nt * gae
                adv[t] = gae
            ret = adv + val_t

        b_obs, b_act = obs_t.view(-1, obs_dim), act_t.view(-1, act_dim)
        b_logp, b_adv, b_ret = logp_t.view(-1), adv.view(-1), ret.view(-1)
        n = b_obs.shape[0]
        for _ in range(args.epochs):
            perm = torch.randperm(n, device=device)
            for s in range(0, n, args.mb_size):
                idx = perm[s:s + args.mb_size]
                _, lp, ent, v = model(b_obs[idx], b_act[idx])
                ratio = (lp - b_logp[idx]).exp()
                mb_adv = (b_adv[idx] - b_adv[idx].mean()) / (b_adv[idx].std() + 1e-8)
                pg = -torch.min(ratio * mb_adv, ratio.clamp(1 - args.clip, 1 + args.clip) * mb_adv).mean()
                vl = 0.5 * (v - b_ret[idx]).pow(2).mean()
                loss = pg + args.vf_coef * vl - args.ent_coef * ent.mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()

        dist.all_reduce(ep_stats)
        if writer is not None:
            step = (it + 1) * T * N * world
            writer.add_scalar("loss/pg", pg.item(), step)
            writer.add_scalar("loss/v", vl.item(), step)
            writer.add_scalar("perf/fps", (it + 1 - start_it) * T * N * world / (time.time() - tic), step)
            if ep_stats[2] > 0:
                writer.add_scalar("rollout/ep_return", (ep_stats[0] / ep_stats[2]).item(), step)
                writer.add_scalar("rollout/success_rate", (ep_stats[1] / ep_stats[2]).item(), step)

        if (it + 1) % args.ckpt_every == 0:
            path = ckpts.save(it + 1, policy, optimizer, extra={"env_id": args.env_id, "world_size": world})
            if rank == 0:
                print(f"iteration {it + 1}: saved {path}", flush=True)

    if writer is not None:
        writer.close()
    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
