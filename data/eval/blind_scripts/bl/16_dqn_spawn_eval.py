#!/usr/bin/env python3
"""DQN for classic-control tasks on several GPUs of one machine, started with mp.spawn.

Rank 0 periodically runs greedy evaluation episodes and decides whether the
task is solved; the decision is broadcast so that all ranks stop together.

    python 16_dqn_spawn_eval.py --env-id CartPole-v1 --nprocs 4
"""
import argparse
import os
import random
import time
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SOLVED_AT = {"CartPole-v1": 475.0, "Acrobot-v1": -80.0, "MountainCar-v0": -110.0, "LunarLander-v2": 200.0}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--nprocs", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29512)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=500_000, help="env steps per rank")
    p.add_argument("--buffer", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=128, help="global batch, divided over the ranks")
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--target-every", type=int, default=500)
    p.add_argument("--start", type=int, default=10_000)
    p.add_argument("--train-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=10_000)
    p.add_argument("--ckpt", default="dqn_ckpt/dqn.pt")
    return p.parse_args()


class QNet(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                 nn.Linear(84, n_actions))

    def forward(self, x):
        return self.net(x)


class Buffer:
    def __init__(self, size, obs_dim):
        self.o = np.zeros((size, obs_dim), np.float32)
        self.o2 = np.zeros((size, obs_dim), np.float32)
        self.a = np.zeros(size, np.int64)
        self.r = np.zeros(size, np.float32)
        self.d = np.zeros(size, np.float32)
        self.size, self.ptr, self.n = size, 0, 0

    def add(self, o, a, r, o2, d):
        for i in range(len(o)):
            self.o[self.ptr], self.a[self.ptr], self.r[self.ptr] = o[i], a[i], r[i]
            self.o2[self.ptr], self.d[self.ptr] = o2[i], d[i]
            self.ptr = (self.ptr + 1) % self.size
            self.n = min(self.n + 1, self.size)

    def sample(self, k, device):
        j = np.random.randint(0, self.n, size=k)
        return (torch.from_numpy(self.o[j]).to(device), torch.from_numpy(self.a[j]).to(device),
                torch.from_numpy(self.r[j]).to(device), torch.from_numpy(self.o2[j]).to(device),
                torch.from_numpy(self.d[j]).to(device))


def greedy_eval(q, env_id, device, episodes=10, seed=123_456):
    env = gym.make(env_id)
    scores = []
    for ep in range(episodes):
        o, _ = env.reset(seed=seed + ep)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                a = q(torch.as_tensor(o, dtype=torch.float32, device=device)[None]).argmax(1).item()
            o, r, term, trunc, _ = env.step(a)
            total += r
            done = term or trunc
        scores.append(total)
    env.close()
    return float(np.mean(scores))


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    envs = gym.vector.SyncVectorEnv([lambda: gym.make(args.env_id) for _ in range(args.num_envs)])
    obs_dim = envs.single_observation_space.shape[0]
    n_actions = envs.single_action_space.n

    q = QNet(obs_dim, n_actions).to(device)
    opt = torch.optim.Adam(q.parameters(), lr=args.lr)
    start_step = 0
    if os.path.exists(args.ckpt):
        # every rank reads the same file; the tensors were saved from cuda:0, so remap to our own GPU
        ck = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{rank}"})
        q.load_state_dict(ck["q"])
        opt.load_state_dict(ck["opt"])
        start_step = ck["step"]
    q = DDP(q, device_ids=[rank])
    q_target = QNet(obs_dim, n_actions).to(device)
    q_target.load_state_dict(q.module.state_dict())

    buf = Buffer(args.buffer, obs_dim)
    obs, _ = envs.reset(seed=args.seed + 100 * rank)
    recent = deque(maxlen=50)
    ep_ret = np.zeros(args.num_envs)
    tic = time.time()
    best = -float("inf")

    for step in range(start_step, args.steps, args.num_envs):
        eps = max(0.05, 1.0 - step / (0.5 * args.steps))
        if random.random() < eps:
            act = envs.action_space.sample()
        else:
            with torch.no_grad():
                act = q.module(torch.as_tensor(obs, dtype=torch.float32, device=device)).argmax(1).cpu().numpy()
        nobs, r, term, trunc, info = envs.step(act)
        real = nobs.copy()
        if "final_observation" in info:
            for i in np.nonzero(info["_final_observation"])[0]:
                real[i] = info["final_observation"][i]
        buf.add(obs, act, r, real, term)
        ep_ret += r
        for i in np.nonzero(term | trunc)[0]:
            recent.append(ep_ret[i])
            ep_ret[i] = 0.0
        obs = nobs

        k = step // args.num_envs
        if buf.n >= args.start and k % args.train_every == 0:
            o, a, rr, o2, d = buf.sample(args.batch // world_size, device)
            with torch.no_grad():
                y = rr + args.gamma * q_target(o2).max(1).values * (1 - d)
            pred = q(o).gather(1, a[:, None]).squeeze(1)
            loss = F.mse_loss(pred, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if k % args.target_every == 0:
                for tp, p in zip(q_target.parameters(), q.module.parameters()):
                    tp.data.copy_(args.tau * p.data + (1 - args.tau) * tp.data)

        if step > 0 and k % (args.eval_every // args.num_envs) == 0:
            # only rank 0 evaluates; it uses the bare module so no collective is involved
            decision = [False]
            if rank == 0:
                score = greedy_eval(q.module, args.env_id, device)
                print(f"step {step * world_size} eval {score:.1f} train(rank0) "
                      f"{np.mean(recent) if recent else float('nan'):.1f} eps {eps:.2f} "
                      f"{(step - start_step) * world_size / (time.time() - tic):.0f} sps", flush=True)
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"q": q.module.state_dict(), "opt": opt.state_dict(), "step": step + args.num_envs},
                           args.ckpt)
                if score > best:
                    best = score
                    torch.save(q.module.state_dict(), args.ckpt.replace(".pt", "_best.pt"))
                decision = [score >= SOLVED_AT.get(args.env_id, float("inf"))]
            dist.broadcast_object_list(decision, src=0)
            if decision[0]:
                if rank == 0:
                    print("solved, stopping")
                break

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    cli = get_args()
    n = cli.nprocs
    mp.spawn(worker, args=(n, cli), nprocs=n, join=True)
