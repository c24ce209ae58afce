"""DD-PPO PointNav on HM3D with scene-sharded workers.

Loading all 800 HM3D train scenes on every rank blows the host RAM, so each rank
gets its own shard of scenes. A few train scenes are held out for a quick
"val-seen-like" check that runs on every rank during training.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        pointnav_sharded.py habitat_cfg=benchmark/nav/pointnav/pointnav_hm3d.yaml
"""
import functools
import os
import random
import sys
import time
from collections import deque

import gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

import habitat
from habitat.config import read_write
from habitat.config.default import get_config
from habitat.gym import make_gym_from_config

CFG = OmegaConf.create(dict(
    habitat_cfg="benchmark/nav/pointnav/pointnav_hm3d.yaml",
    envs_per_rank=8, rollout_len=128, total_frames=2.5e9, lr=2.5e-4, epochs=2, mini_batches=2,
    clip=0.2, vf_coef=0.5, ent_coef=0.01, gamma=0.99, gae_lambda=0.95, grad_clip=0.2,
    hidden=512, sync_frac=0.6, n_holdout_scenes=20, holdout_every=100, holdout_episodes=32,
    log_every=10, save_every=250, out="runs/pointnav_sharded", seed=1234,
))


def make_env(habitat_cfg_path, scenes, gpu_id, seed):
    cfg = get_config(habitat_cfg_path)
    with read_write(cfg):
        cfg.habitat.dataset.content_scenes = list(scenes)
        cfg.habitat.simulator.habitat_sim_v0.gpu_device_id = gpu_id
        cfg.habitat.seed = seed
    env = make_gym_from_config(cfg)
    env.seed(seed)
    return env


class Agent(nn.Module):
    def __init__(self, hidden=512, n_actions=4):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 32, 8, 4), nn.GroupNorm(8, 32), nn.ReLU(True),
            nn.Conv2d(32, 64, 4, 2), nn.GroupNorm(8, 64), nn.ReLU(True),
            nn.Conv2d(64, 64, 3, 1), nn.GroupNorm(8, 64), nn.ReLU(True),
            nn.AdaptiveAvgPool2d((4, 4)), nn.Flatten(), nn.Linear(64 * 16, hidden), nn.ReLU(True))
        self.goal = nn.Linear(3, 32)
        self.gru = nn.GRU(hidden + 32, hidden)
        self.pi = nn.Linear(hidden, n_actions)
        self.vf = nn.Linear(hidden, 1)

    def core(self, depth, goal, h, masks):
        x = self.cnn(depth.permute(0, 3, 1, 2))
        g = torch.stack([goal[:, 0], goal[:, 1].cos(), goal[:, 1].sin()], -1)
        x = torch.cat([x, F.relu(self.goal(g))], -1)
        n = h.shape[1]
        x, masks = x.view(-1, n, x.shape[-1]), masks.view(-1, n, 1)
        out = []
        for t in range(x.shape[0]):
            o, h = self.gru(x[t:t + 1], h * masks[t].unsqueeze(0))
            out.append(o)
        return torch.cat(out).flatten(0, 1), h

    def forward(self, depth, goal, h, masks, actions=None):
        feat, h = self.core(depth, goal, h, masks)
        d = torch.distributions.Categorical(logits=self.pi(feat))
        if actions is None:
            actions = d.sample()
        return actions, d.log_prob(actions), d.entropy(), self.vf(feat).squeeze(-1), h


def to_t(obs, device):
    return (torch.as_tensor(obs["depth"], dtype=torch.float32, device=device),
            torch.as_tensor(obs["pointgoal_with_gps_compass"], dtype=torch.float32, device=device))


@torch.no_grad()
def run_holdout(agent, env, episodes, hidden, device):
    succ, spl = [], []
    for _ in range(episodes):
        obs, done = env.reset(), False
        h = torch.zeros(1, 1, hidden, device=device)
        m = torch.zeros(1, device=device)
        while not done:
            depth, goal = to_t({k: v[None] for k, v in obs.items()}, device)
            a, _, _, _, h = agent(depth, goal, h, m)
            obs, _, done, info = env.step(a.item())
            m = torch.ones(1, device=device)
        succ.append(info["success"])
        spl.append(info["spl"])
    return float(np.mean(succ)), float(np.mean(spl))


def main():
    cfg = OmegaConf.merge(CFG, OmegaConf.from_cli(sys.argv[1:]))
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    # per-rank seeds: every rank should explore different episodes
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    base = get_config(cfg.habitat_cfg)
    all_scenes = habitat.make_dataset(base.habitat.dataset.type).get_scenes_to_load(base.habitat.dataset)
    all_scenes = sorted(all_scenes)
    random.shuffle(all_scenes)
    holdout, train_scenes = all_scenes[:cfg.n_holdout_scenes], all_scenes[cfg.n_holdout_scenes:]
    shard = train_scenes[rank::world]
    env_scenes = [shard[i::cfg.envs_per_rank] for i in range(cfg.envs_per_rank)]

    envs = gym.vector.AsyncVectorEnv(
        [functools.partial(make_env, cfg.habitat_cfg, env_scenes[i], local_rank,
                           cfg.seed + rank * cfg.envs_per_rank + i) for i in range(cfg.envs_per_rank)],
        context="forkserver")
    holdout_env = make_env(cfg.habitat_cfg, holdout, local_rank, cfg.seed + 99991 + rank)

    agent = Agent(cfg.hidden).to(dev)
    ddp_agent = DDP(agent, device_ids=[local_rank])
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
    tracker = dist.PrefixStore("rollouts", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0))
    tracker.set("n", "0")

    T, N = cfg.rollout_len, cfg.envs_per_rank
    obs = envs.reset()
    depth, goal = to_t(obs, dev)
    B = dict(depth=torch.zeros(T + 1, *depth.shape, device=dev), goal=torch.zeros(T + 1, N, 2, device=dev),
             h=torch.zeros(T + 1, 1, N, cfg.hidden, device=dev), m=torch.zeros(T + 1, N, device=dev),
             a=torch.zeros(T, N, dtype=torch.long, device=dev), lp=torch.zeros(T, N, device=dev),
             v=torch.zeros(T + 1, N, device=dev), r=torch.zeros(T, N, device=dev))
    B["depth"][0], B["goal"][0] = depth, goal
    ep_ret = np.zeros(N)
    window = deque(maxlen=100)
    frames, upd, t0 = 0, 0, time.time()
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    while frames < cfg.total_frames:
        for g in opt.param_groups:
            g["lr"] = cfg.lr * (1 - frames / cfg.total_frames)
        L = 0
        for t in range(T):
            with torch.no_grad():
                a, lp, _, v, h = agent(B["depth"][t], B["goal"][t], B["h"][t], B["m"][t])
            obs, rew, done, infos = envs.step(a.cpu().numpy())
            ep_ret += rew
            for i in np.flatnonzero(done):
                window.append((ep_ret[i], infos["success"][i], infos["spl"][i]))
                ep_ret[i] = 0
            depth, goal = to_t(obs, dev)
            B["depth"][t + 1], B["goal"][t + 1], B["h"][t + 1] = depth, goal, h
            B["m"][t + 1] = torch.as_tensor(1.0 - done, dtype=torch.float32, device=dev)
            B["a"][t], B["lp"][t], B["v"][t] = a, lp, v
            B["r"][t] = torch.as_tensor(rew, dtype=torch.float32, device=dev)
            L = t + 1
            if L >= T // 4 and int(tracker.get("n")) >= cfg.sync_frac * world:
                break
        tracker.add("n", 1)

        with torch.no_grad():
            B["v"][L] = agent(B["depth"][L], B["goal"][L], B["h"][L], B["m"][L])[3]
        adv = torch.zeros(L, N, device=dev)
        gae = torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            delta = B["r"][t] + cfg.gamma * B["v"][t + 1] * B["m"][t + 1] - B["v"][t]
            gae = delta + cfg.gamma * cfg.gae_lambda * B["m"][t + 1] * gae
            adv[t] = gae
        ret = adv + B["v"][:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)

        per = N // cfg.mini_batches
        for _ in range(cfg.epochs):
            perm = torch.randperm(N, device=dev)
            for j in range(cfg.mini_batches):
                idx = perm[j * per:(j + 1) * per]
                _, nlp, ent, nv, _ = ddp_agent(B["depth"][:L, idx].flatten(0, 1), B["goal"][:L, idx].flatten(0, 1),
                                               B["h"][0][:, idx], B["m"][:L, idx].flatten(0, 1),
                                               B["a"][:L, idx].flatten(0, 1))
                mb_adv = adv[:, idx].flatten()
                ratio = (nlp - B["lp"][:L, idx].flatten()).exp()
                pg = -torch.min(ratio * mb_adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * mb_adv).mean()
                vl = 0.5 * (ret[:, idx].flatten() - nv).pow(2).mean()
                opt.zero_grad()
                (pg + cfg.vf_coef * vl - cfg.ent_coef * ent.mean()).backward()
                nn.utils.clip_grad_norm_(agent.parameters(), cfg.grad_clip)
                opt.step()
        for k in ("depth", "goal", "h", "m"):
            B[k][0] = B[k][L]

        w = np.array(window) if window else np.zeros((0, 3))
        s = torch.tensor([L * N, w[:, 0].sum(), w[:, 1].sum(), w[:, 2].sum(), len(w)],
                         dtype=torch.float64, device=dev)
        dist.all_reduce(s)
        frames += int(s[0].item())
        if rank == 0:
            tracker.set("n", "0")
        upd += 1

        if upd % cfg.holdout_every == 0:
            hs = torch.tensor(run_holdout(agent, holdout_env, cfg.holdout_episodes, cfg.hidden, dev), device=dev)
            dist.all_reduce(hs)
            hs /= world
            if rank == 0:
                print(f"[holdout] update {upd} success {hs[0]:.3f} spl {hs[1]:.3f}", flush=True)
        if rank == 0 and upd % cfg.log_every == 0:
            n = max(s[4].item(), 1)
            print(f"update {upd} frames {frames:.3e} fps {frames / (time.time() - t0):.0f} "
                  f"return {s[1] / n:.2f} success {s[2] / n:.3f} spl {s[3] / n:.3f}", flush=True)
        if rank == 0 and upd % cfg.save_every == 0:
            torch.save({"agent": agent.state_dict(), "opt": opt.state_dict(), "frames": frames, "update": upd},
                       os.path.join(cfg.out, f"ckpt_{upd}.pt"))

    envs.close()
    holdout_env.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
