"""Double DQN on Atari, data parallel over the GPUs of one node.

Each process owns one GPU, a few envs and its own replay buffer; the online
Q-network is DDP-wrapped, the target network is a plain copy refreshed from it.

    python 13_dqn_mp_spawn_ddp.py --env ALE/Breakout-v5 --gpus 4
"""
import argparse
import copy
import os
import random
import socket
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


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="ALE/Breakout-v5")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--envs-per-gpu", type=int, default=4)
    ap.add_argument("--total-frames", type=int, default=40_000_000)
    ap.add_argument("--buffer", type=int, default=250_000, help="per process")
    ap.add_argument("--batch", type=int, default=64, help="per process")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--target-every", type=int, default=2000)
    ap.add_argument("--learn-start", type=int, default=20_000)
    ap.add_argument("--eps-decay-steps", type=int, default=250_000)
    ap.add_argument("--out", default="dqn_runs")
    return ap.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def make_env(env_id, seed):
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, terminal_on_life_loss=False)
    env = gym.wrappers.FrameStack(env, 4)
    env.reset(seed=seed)
    env.action_space.seed(seed)
    return env


class Replay:
    def __init__(self, cap):
        self.obs = np.zeros((cap, 4, 84, 84), np.uint8)
        self.nxt = np.zeros((cap, 4, 84, 84), np.uint8)
        self.act = np.zeros(cap, np.int64)
        self.rew = np.zeros(cap, np.float32)
        self.done = np.zeros(cap, np.float32)
        self.cap, self.i, self.n = cap, 0, 0

    def add(self, o, a, r, o2, d):
        self.obs[self.i], self.act[self.i], self.rew[self.i], self.nxt[self.i], self.done[self.i] = o, a, r, o2, d
        self.i = (self.i + 1) % self.cap
        self.n = min(self.n + 1, self.cap)

    def sample(self, k, device):
        j = np.random.randint(0, self.n, k)
        f = lambda x, dt=None: torch.as_tensor(x[j], device=device, dtype=dt)
        return f(self.obs), f(self.act), f(self.rew), f(self.nxt), f(self.done)


class QNet(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, n_actions))

    def forward(self, x):
        return self.head(self.conv(x.float() / 255.0))


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    seed = 1000 * rank + 17
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(0)

    envs = [make_env(args.env, seed + i) for i in range(args.envs_per_gpu)]
    n_actions = envs[0].action_space.n
    obs = [np.asarray(e.reset()[0]) for e in envs]

    q = DDP(QNet(n_actions).to(device), device_ids=[rank])
    target = copy.deepcopy(q.module).eval()
    opt = torch.optim.Adam(q.parameters(), lr=args.lr, eps=1.5e-4)
    rb = Replay(args.buffer)

    frames_per_step = 4 * args.envs_per_gpu * world_size
    total_steps = args.total_frames // frames_per_step
    ep_ret = [0.0] * len(envs)
    finished = deque(maxlen=100)
    t0 = time.time()

    for step in range(total_steps):
        eps = max(0.01, 1.0 - step * args.envs_per_gpu / args.eps_decay_steps)
        with torch.no_grad():
            qs = q.module(torch.as_tensor(np.stack(obs), device=device))
        greedy = qs.argmax(1).cpu().numpy()
        for k, env in enumerate(envs):
            a = env.action_space.sample() if random.random() < eps else int(greedy[k])
            o2, r, term, trunc, _ = env.step(a)
            o2 = np.asarray(o2)
            rb.add(obs[k], a, np.sign(r), o2, float(term))
            ep_ret[k] += r
            if term or trunc:
                finished.append(ep_ret[k])
                ep_ret[k] = 0.0
                o2 = np.asarray(env.reset()[0])
            obs[k] = o2

        # every rank starts learning at the same step and does one update per step
        if step * args.envs_per_gpu >= args.learn_start:
            o, a, r, o2, d = rb.sample(args.batch, device)
            with torch.no_grad():
                next_a = q.module(o2).argmax(1, keepdim=True)
                next_q = target(o2).gather(1, next_a).squeeze(1)
                y = r + args.gamma * (1 - d) * next_q
            pred = q(o).gather(1, a.unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(q.parameters(), 10.0)
            opt.step()

            if step % args.target_every == 0:
                target.load_state_dict(q.module.state_dict())

        if step % 10_000 == 0:
            stat = torch.tensor([np.mean(finished) if finished else 0.0, len(finished) > 0], device=device,
                                dtype=torch.float32)
            dist.all_reduce(stat)
            if rank == 0:
                mean_ret = (stat[0] / stat[1].clamp(min=1)).item()
                fps = (step + 1) * frames_per_step / (time.time() - t0)
                print(f"step {step}/{total_steps} frames {(step + 1) * frames_per_step} eps {eps:.3f} "
                      f"return(100) {mean_ret:.2f} fps {fps:.0f}", flush=True)

        if rank == 0 and step > 0 and step % 200_000 == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"q": q.module.state_dict(), "step": step}, os.path.join(args.out, f"dqn_{step}.pt"))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"q": q.module.state_dict(), "step": total_steps}, os.path.join(args.out, "dqn_final.pt"))
    for e in envs:
        e.close()
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = get_args()
    assert 0 < args.gpus <= torch.cuda.device_count(), "not enough GPUs"
    port = free_port()
    mp.spawn(worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
