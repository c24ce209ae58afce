"""Multi-task PPO for locomotion: one task per GPU, one shared policy.

Each rank trains on a single task from --tasks (rank i gets tasks[i % len(tasks)]);
DDP averages the gradients so the shared network sees all tasks every update.

Launch (single node, 4 GPUs):
    torchrun --standalone --nproc_per_node=4 multitask_ppo.py \
        --tasks HalfCheetah-v4,Walker2d-v4,Hopper-v4,Ant-v4
"""
import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Config:
    tasks: str = "HalfCheetah-v4,Walker2d-v4,Hopper-v4,Ant-v4"
    num_envs: int = 16
    horizon: int = 256
    iterations: int = 3000
    epochs: int = 5
    minibatches: int = 4
    lr: float = 2.5e-4
    gamma: float = 0.99
    lam: float = 0.95
    clip: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    max_grad_norm: float = 1.0
    hidden: int = 512
    seed: int = 3
    logdir: str = "runs/multitask_ppo"
    eval_every: int = 100
    eval_episodes: int = 5


def get_config():
    p = argparse.ArgumentParser()
    for k, v in asdict(Config()).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    return Config(**vars(p.parse_args()))


class MultiTaskActorCritic(nn.Module):
    def __init__(self, obs_dim, act_dim, n_tasks, hidden):
        super().__init__()
        self.task_emb = nn.Embedding(n_tasks, 32)
        self.trunk = nn.Sequential(
            nn.Linear(obs_dim + 32, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
        )
        self.mu = nn.Linear(hidden, act_dim)
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))
        self.value = nn.Linear(hidden, 1)
        nn.init.orthogonal_(self.mu.weight, 0.01)
        nn.init.zeros_(self.mu.bias)

    def forward(self, obs, task_id):
        emb = self.task_emb(task_id).expand(obs.shape[0], -1)
        h = self.trunk(torch.cat([obs, emb], dim=-1))
        return Normal(self.mu(h), self.log_std.exp()), self.value(h).squeeze(-1)


def compute_gae(rew, val, done, last_val, gamma, lam):
    adv = torch.zeros_like(rew)
    gae = torch.zeros_like(last_val)
    for t in reversed(range(rew.shape[0])):
        nxt = last_val if t == rew.shape[0] - 1 else val[t + 1]
        nonterm = 1.0 - done[t]
        delta = rew[t] + gamma * nxt * nonterm - val[t]
        gae = delta + gamma * lam * nonterm * gae
        adv[t] = gae
    return adv, adv + val


@torch.no_grad()
def evaluate(policy, env_name, task_id, device, episodes, seed):
    env = gym.make(env_name)
    scores = []
    for ep in range(episodes):
        o, _ = env.reset(seed=seed + ep)
        done, total = False, 0.0
        while not done:
            d, _ = policy(torch.as_tensor(o, dtype=torch.float32, device=device)[None], task_id)
            o, r, term, trunc, _ = env.step(d.mean[0].cpu().numpy())
            total += r
            done = term or trunc
        scores.append(total)
    env.close()
    return float(np.mean(scores))


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    task_names = cfg.tasks.split(",")
    my_task = task_names[rank % len(task_names)]
    task_id = torch.tensor([rank % len(task_names)], device=device)

    envs = gym.vector.SyncVectorEnv([
        (lambda s=s: gym.wrappers.RecordEpisodeStatistics(gym.make(my_task)))
        for s in range(cfg.num_envs)
    ])
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]

    torch.manual_seed(cfg.seed)
    policy = MultiTaskActorCritic(obs_dim, act_dim, len(task_names), cfg.hidden).to(device)
    ddp_policy = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp_policy.parameters(), lr=cfg.lr)
    torch.manual_seed(cfg.seed + rank)

    writer = None
    if rank == 0:
        writer = SummaryWriter(cfg.logdir)
        with open(os.path.join(cfg.logdir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    H, N = cfg.horizon, cfg.num_envs
    obs_b = torch.zeros(H, N, obs_dim, device=device)
    act_b = torch.zeros(H, N, act_dim, device=device)
    logp_b = torch.zeros(H, N, device=device)
    rew_b = torch.zeros(H, N, device=device)
    done_b = torch.zeros(H, N, device=device)
    val_b = torch.zeros(H, N, device=device)

    obs, _ = envs.reset(seed=cfg.seed * 1000 + rank * N)
    obs = torch.as_tensor(obs, dtype=torch.float32, device=device)
    best = -float("inf")
    t_start = time.time()

    for it in range(cfg.iterations):
        for t in range(H):
            with torch.no_grad():
                d, v = policy(obs, task_id)
                a = d.sample()
            obs_b[t], act_b[t], logp_b[t], val_b[t] = obs, a, d.log_prob(a).sum(-1), v
            nobs, r, term, trunc, info = envs.step(a.cpu().numpy())
            rew_b[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            done_b[t] = torch.as_tensor(term | trunc, dtype=torch.float32, device=device)
            obs = torch.as_tensor(nobs, dtype=torch.float32, device=device)
            if writer is not None and "final_info" in info:
                for fi in info["final_info"]:
                    if fi and "episode" in fi:
                        writer.add_scalar(f"train/{my_task}/episode_return", fi["episode"]["r"], it)

        with torch.no_grad():
            _, last_v = policy(obs, task_id)
        adv, ret = compute_gae(rew_b, val_b, done_b, last_v, cfg.gamma, cfg.lam)

        flat = lambda x: x.reshape(H * N, *x.shape[2:])
        b_obs, b_act, b_logp, b_adv, b_ret = map(flat, (obs_b, act_b, logp_b, adv, ret))
        b_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)

        mb_size = H * N // cfg.minibatches
        for _ in range(cfg.epochs):
            perm = torch.randperm(H * N, device=device)
            for i in range(cfg.minibatches):
                idx = perm[i * mb_size:(i + 1) * mb_size]
                d, v = ddp_policy(b_obs[idx], task_id)
                ratio = (d.log_prob(b_act[idx]).sum(-1) - b_logp[idx]).exp()
                pg = -torch.min(ratio * b_adv[idx], ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * b_adv[idx]).mean()
                vl = 0.5 * (v - b_ret[idx]).pow(2).mean()
                ent = d.entropy().sum(-1).mean()
                loss = pg + cfg.vf_coef * vl - cfg.ent_coef * ent
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(ddp_policy.parameters(), cfg.max_grad_norm)
                opt.step()

        if writer is not None:
            writer.add_scalar("loss/policy", pg.item(), it)
            writer.add_scalar("loss/value", vl.item(), it)
            writer.add_scalar("perf/sps", (it + 1) * H * N * world / (time.time() - t_start), it)

        if (it + 1) % cfg.eval_every == 0:
            score = torch.tensor(
                evaluate(policy, my_task, task_id, device, cfg.eval_episodes, seed=10_000 + it), device=device
            )
            scores = [torch.zeros_like(score) for _ in range(world)]
            dist.all_gather(scores, score)
            avg = torch.stack(scores).mean().item()
            if rank == 0:
                for r_, s_ in enumerate(scores):
                    writer.add_scalar(f"eval/{task_names[r_ % len(task_names)]}/rank{r_}", s_.item(), it)
                writer.add_scalar("eval/mean_return", avg, it)
                print(f"[it {it + 1}] mean eval return across tasks: {avg:.1f}")
                torch.save({"policy": policy.state_dict(), "iteration": it + 1, "tasks": task_names},
                           os.path.join(cfg.logdir, "last.pt"))
                if avg > best:
                    best = avg
                    torch.save({"policy": policy.state_dict(), "iteration": it + 1, "tasks": task_names},
                               os.path.join(cfg.logdir, "best.pt"))

    if writer is not None:
        writer.close()
    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
