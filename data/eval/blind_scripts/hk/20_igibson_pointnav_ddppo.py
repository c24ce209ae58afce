"""iGibson 2.0 PointNav (Turtlebot, continuous velocity control) with DD-PPO.

    torchrun --nproc_per_node=4 igibson_ddppo.py --config configs/turtlebot_pointnav.yaml \
        --run-name tb_pointnav_rgbd_s1
"""
import argparse
import functools
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
import yaml
from igibson.envs.igibson_env import iGibsonEnv
from igibson.envs.parallel_env import ParallelNavEnv
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/turtlebot_pointnav.yaml")
    p.add_argument("--run-name", default=None)
    p.add_argument("--project", default="igibson-ddppo")
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--updates", type=int, default=40000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--mini-batches", type=int, default=4)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--sync-frac", type=float, default=0.6)
    p.add_argument("--out", default="runs/igibson")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class AutoReset:
    """Resets the wrapped env inside the worker when an episode ends."""

    def __init__(self, env):
        self.env = env
        self.observation_space, self.action_space = env.observation_space, env.action_space

    def reset(self):
        return self.env.reset()

    def step(self, action):
        obs, rew, done, info = self.env.step(action)
        if done:
            obs = self.env.reset()
        return obs, rew, done, info

    def close(self):
        self.env.close()


def make_env(config_file, scene_id, gpu, seed):
    env = iGibsonEnv(config_file=config_file, scene_id=scene_id, mode="headless", action_timestep=1 / 10.0,
                     physics_timestep=1 / 120.0, device_idx=gpu)
    env.seed(seed)
    return AutoReset(env)


class GaussianActorCritic(nn.Module):
    def __init__(self, task_dim, act_dim, hidden=256):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(True), nn.Conv2d(32, 64, 4, 2), nn.ReLU(True),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(True), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            nn.Linear(64 * 16, hidden), nn.ReLU(True))
        self.task = nn.Sequential(nn.Linear(task_dim, 64), nn.ReLU(True))
        self.body = nn.Sequential(nn.Linear(hidden + 64, hidden), nn.Tanh())
        self.mu = nn.Linear(hidden, act_dim)
        self.log_std = nn.Parameter(torch.zeros(act_dim))
        self.v = nn.Linear(hidden, 1)

    def forward(self, img, task, actions=None):
        h = self.body(torch.cat([self.cnn(img.permute(0, 3, 1, 2)), self.task(task)], -1))
        d = torch.distributions.Normal(self.mu(h), self.log_std.exp())
        if actions is None:
            actions = d.sample()
        return actions, d.log_prob(actions).sum(-1), d.entropy().sum(-1).mean(), self.v(h).squeeze(-1)


def obs_to_tensors(obs_list, device):
    img = np.stack([np.concatenate([o["rgb"], o["depth"]], -1) for o in obs_list])
    task = np.stack([o["task_obs"] for o in obs_list])
    return torch.as_tensor(img, dtype=torch.float, device=device), torch.as_tensor(task, dtype=torch.float,
                                                                                    device=device)


def main():
    args = get_args()
    with open(args.config) as f:
        env_cfg = yaml.safe_load(f)
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    # start the simulator workers (forked) before this process touches CUDA
    scenes = env_cfg.get("train_scenes", [env_cfg["scene_id"]])
    fns = [functools.partial(make_env, args.config, scenes[(rank * args.envs + i) % len(scenes)], local_rank,
                             args.seed + rank * args.envs + i) for i in range(args.envs)]
    envs = ParallelNavEnv(fns, blocking=False)

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    wandb.init(project=args.project, name=args.run_name, config={**vars(args), "env": env_cfg, "world": world})

    obs = envs.reset()
    img, task = obs_to_tensors(obs, dev)
    act_dim = envs.action_space.shape[0]
    low = torch.as_tensor(envs.action_space.low, device=dev)
    high = torch.as_tensor(envs.action_space.high, device=dev)

    model = GaussianActorCritic(task.shape[1], act_dim).to(dev)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    store = dist.PrefixStore("tracker", dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                                                      world, rank == 0))
    store.set("num_done", "0")

    T, N = args.steps, args.envs
    B_img = torch.zeros(T + 1, *img.shape, device=dev)
    B_task = torch.zeros(T + 1, *task.shape, device=dev)
    B_act = torch.zeros(T, N, act_dim, device=dev)
    B_lp, B_rew = torch.zeros(T, N, device=dev), torch.zeros(T, N, device=dev)
    B_val, B_mask = torch.zeros(T + 1, N, device=dev), torch.ones(T + 1, N, device=dev)
    B_img[0], B_task[0] = img, task
    win, ep_r = deque(maxlen=100), np.zeros(N)
    frames, t0 = 0, time.time()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for update in range(args.updates):
        for g in opt.param_groups:
            g["lr"] = args.lr * (1 - update / args.updates)
        L = 0
        for t in range(T):
            with torch.no_grad():
                a, lp, _, v = model(B_img[t], B_task[t])
            res = envs.step(torch.max(torch.min(a, high), low).cpu().numpy())
            obs, rew, done, info = [list(x) for x in zip(*res)]
            ep_r += rew
            for i in np.flatnonzero(done):
                win.append((ep_r[i], float(info[i]["success"]), float(info[i]["spl"])))
                ep_r[i] = 0
            B_img[t + 1], B_task[t + 1] = obs_to_tensors(obs, dev)
            B_mask[t + 1] = torch.as_tensor(1.0 - np.asarray(done, dtype=np.float32), device=dev)
            B_rew[t] = torch.as_tensor(rew, dtype=torch.float, device=dev)
            B_act[t], B_lp[t], B_val[t] = a, lp, v
            L = t + 1
            if L >= T // 4 and int(store.get("num_done")) >= args.sync_frac * world:
                break
        store.add("num_done", 1)

        with torch.no_grad():
            B_val[L] = model(B_img[L], B_task[L])[3]
        adv, gae = torch.zeros(L, N, device=dev), torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            delta = B_rew[t] + args.gamma * B_val[t + 1] * B_mask[t + 1] - B_val[t]
            gae = delta + args.gamma * args.lam * B_mask[t + 1] * gae
            adv[t] = gae
        ret = adv + B_val[:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)

        per = N // args.mini_batches
        for _ in range(args.epochs):
            perm = torch.randperm(N, device=dev)
            for j in range(args.mini_batches):
                idx = perm[j * per:(j + 1) * per]
                _, nlp, ent, nv = ddp(B_img[:L, idx].flatten(0, 1), B_task[:L, idx].flatten(0, 1),
                                      B_act[:L, idx].flatten(0, 1))
                ratio = (nlp - B_lp[:L, idx].flatten()).exp()
                mb_adv = adv[:, idx].flatten()
                pg = -torch.min(ratio * mb_adv, ratio.clamp(1 - args.clip, 1 + args.clip) * mb_adv).mean()
                vl = 0.5 * (ret[:, idx].flatten() - nv).pow(2).mean()
                opt.zero_grad()
                (pg + 0.5 * vl - 0.005 * ent).backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
        B_img[0], B_task[0], B_mask[0] = B_img[L], B_task[L], B_mask[L]

        w = np.asarray(win, dtype=np.float64).reshape(-1, 3)
        s = torch.tensor([L * N, len(w), *w.sum(0), pg.item(), vl.item()], dtype=torch.float64, device=dev)
        dist.all_reduce(s)
        frames += int(s[0].item())
        if rank == 0:
            store.set("num_done", "0")
            n = max(s[1].item(), 1)
            wandb.log({"frames": frames, "fps": frames / (time.time() - t0), "return": s[2].item() / n,
                       "success": s[3].item() / n, "spl": s[4].item() / n, "loss/policy": s[5].item() / world,
                       "loss/value": s[6].item() / world, "lr": opt.param_groups[0]["lr"]}, step=update)
            if (update + 1) % 500 == 0:
                path = os.path.join(args.out, f"ckpt_{update + 1:06d}.pt")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "update": update + 1}, path)

    envs.close()
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
