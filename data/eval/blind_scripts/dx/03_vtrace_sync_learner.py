#!/usr/bin/env python
# Synchronous V-trace actor-critic for Procgen-style discrete games.
# Every GPU process steps its own AsyncVectorEnv, keeps a slightly stale
# behaviour policy for acting and corrects the off-policyness with V-trace.
#
#   torchrun --standalone --nproc_per_node=8 vtrace_sync_learner.py --env procgen:procgen-coinrun-v0
import argparse
import copy
import os
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP


def build_parser():
    parser = argparse.ArgumentParser(description="sync v-trace")
    parser.add_argument("--env", default="procgen:procgen-coinrun-v0")
    parser.add_argument("--envs-per-gpu", type=int, default=64)
    parser.add_argument("--rollout", type=int, default=64)
    parser.add_argument("--updates", type=int, default=20000)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--gamma", type=float, default=0.999)
    parser.add_argument("--ent", type=float, default=0.01)
    parser.add_argument("--vf", type=float, default=0.5)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--sync-behaviour-every", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ckpt", default="ckpt/vtrace_latest.pt")
    parser.add_argument("--wandb-project", default="rl-games")
    return parser


def env_factory(env_name, seed):
    def _make():
        env = gym.make(env_name, distribution_mode="easy", start_level=0, num_levels=0, rand_seed=seed)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return env
    return _make


class ImpalaBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.res1 = nn.Sequential(nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1))
        self.res2 = nn.Sequential(nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1))

    def forward(self, x):
        x = F.max_pool2d(self.conv(x), 3, 2, padding=1)
        x = x + self.res1(x)
        return x + self.res2(x)


class Policy(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.body = nn.Sequential(ImpalaBlock(3, 16), ImpalaBlock(16, 32), ImpalaBlock(32, 32), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(32 * 8 * 8, 256), nn.ReLU())
        self.pi = nn.Linear(256, n_actions)
        self.v = nn.Linear(256, 1)

    def forward(self, obs):
        h = self.body(obs.permute(0, 3, 1, 2).float() / 255.0)
        return self.pi(h), self.v(h).squeeze(-1)


@torch.no_grad()
def vtrace_targets(log_rhos, discounts, rewards, values, bootstrap, rho_bar=1.0, c_bar=1.0):
    rhos = log_rhos.exp()
    clipped = rhos.clamp(max=rho_bar)
    cs = rhos.clamp(max=c_bar)
    next_values = torch.cat([values[1:], bootstrap[None]], 0)
    deltas = clipped * (rewards + discounts * next_values - values)
    acc = torch.zeros_like(bootstrap)
    vs_minus_v = torch.zeros_like(values)
    for t in range(values.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values
    next_vs = torch.cat([vs[1:], bootstrap[None]], 0)
    pg_adv = clipped * (rewards + discounts * next_vs - values)
    return vs, pg_adv


def gather_episode_returns(local_returns, device):
    t = torch.tensor(local_returns, dtype=torch.float32, device=device)
    buckets = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(buckets, t)
    return torch.cat(buckets).cpu().numpy()


def main():
    cfg = build_parser().parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    is_main = rank == 0

    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    envs = gym.vector.AsyncVectorEnv(
        [env_factory(cfg.env, cfg.seed * 100_000 + rank * cfg.envs_per_gpu + i) for i in range(cfg.envs_per_gpu)]
    )
    n_actions = envs.single_action_space.n

    net = Policy(n_actions).to(dev)
    behaviour = copy.deepcopy(net).eval()
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, eps=1e-5)
    torch.manual_seed(cfg.seed + rank)

    start_update = 0
    if os.path.exists(cfg.ckpt):
        state = torch.load(cfg.ckpt, map_location=dev)
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
        start_update = state["update"]
        behaviour.load_state_dict(net.state_dict())

    if is_main:
        wandb.init(project=cfg.wandb_project, config=vars(cfg), name=f"vtrace-{cfg.env}-{world}gpu")
        os.makedirs(os.path.dirname(cfg.ckpt), exist_ok=True)

    T, N = cfg.rollout, cfg.envs_per_gpu
    obs_buf = torch.zeros((T + 1, N) + envs.single_observation_space.shape, dtype=torch.uint8, device=dev)
    act_buf = torch.zeros((T, N), dtype=torch.long, device=dev)
    rew_buf = torch.zeros((T, N), device=dev)
    done_buf = torch.zeros((T, N), device=dev)
    blogp_buf = torch.zeros((T, N), device=dev)

    obs, _ = envs.reset()
    recent = deque(maxlen=200)
    tic = time.time()

    for update in range(start_update, cfg.updates):
        if update % cfg.sync_behaviour_every == 0:
            behaviour.load_state_dict(net.state_dict())

        finished = []
        for t in range(T):
            o = torch.from_numpy(obs).to(dev)
            obs_buf[t] = o
            with torch.no_grad():
                logits, _ = behaviour(o)
                d = torch.distributions.Categorical(logits=logits)
                a = d.sample()
            act_buf[t] = a
            blogp_buf[t] = d.log_prob(a)
            obs, r, term, trunc, info = envs.step(a.cpu().numpy())
            rew_buf[t] = torch.from_numpy(r).float().to(dev)
            done_buf[t] = torch.from_numpy(term | trunc).float().to(dev)
            if "final_info" in info:
                for fi in info["final_info"]:
                    if fi is not None and "episode" in fi:
                        finished.append(float(fi["episode"]["r"]))
        obs_buf[T] = torch.from_numpy(obs).to(dev)

        logits, values = model(obs_buf.flatten(0, 1))
        logits = logits.view(T + 1, N, -1)[:-1]
        values = values.view(T + 1, N)
        bootstrap = values[-1].detach()
        values = values[:-1]

        logp_all = F.log_softmax(logits, -1)
        logp = logp_all.gather(-1, act_buf[..., None]).squeeze(-1)
        discounts = (1.0 - done_buf) * cfg.gamma
        vs, pg_adv = vtrace_targets(logp.detach() - blogp_buf, discounts, rew_buf, values.detach(), bootstrap)

        pg_loss = -(logp * pg_adv).mean()
        v_loss = 0.5 * F.mse_loss(values, vs)
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        loss = pg_loss + cfg.vf * v_loss - cfg.ent * entropy

        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()

        all_returns = gather_episode_returns(finished, dev)
        if is_main:
            recent.extend(all_returns.tolist())
            fps = (update - start_update + 1) * T * N * world / (time.time() - tic)
            metrics = {
                "loss/pg": pg_loss.item(), "loss/v": v_loss.item(), "loss/entropy": entropy.item(),
                "grad_norm": gnorm.item(), "fps": fps, "frames": (update + 1) * T * N * world,
            }
            if recent:
                arr = np.asarray(recent)
                metrics.update({"return/mean": arr.mean(), "return/median": np.median(arr),
                                "return/p10": np.percentile(arr, 10), "return/p90": np.percentile(arr, 90)})
            wandb.log(metrics, step=update)

            if (update + 1) % 500 == 0:
                torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "update": update + 1},
                           cfg.ckpt + ".tmp")
                os.replace(cfg.ckpt + ".tmp", cfg.ckpt)

    envs.close()
    if is_main:
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
