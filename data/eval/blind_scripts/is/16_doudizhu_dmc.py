#!/usr/bin/env python
# Deep Monte-Carlo (DouZero-style) self-play for Dou Dizhu, multi-GPU.
#
# One Q(s, a) network per seat (landlord, landlord_up, landlord_down), kept in a
# single module so that checkpoints / optimiser state are one object.  Every
# rank generates its own episodes with epsilon-greedy self-play, then updates
# each seat's network on Monte-Carlo returns.
#
#   torchrun --nproc_per_node=4 doudizhu_dmc.py --savedir /shared/ddz/dmc_run2
import argparse
import os
import random
import time
from collections import deque

import numpy as np
import rlcard
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

POSITIONS = ["landlord", "landlord_up", "landlord_down"]
RANKS = "3456789TJQKA2BR"
ACT_DIM = len(RANKS) * 4 + 1  # multi-hot count per rank + pass flag


def action_features(action):
    v = np.zeros(ACT_DIM, np.float32)
    if action == "pass":
        v[-1] = 1.0
        return v
    for r in set(action):
        n = action.count(r)
        v[RANKS.index(r) * 4 + n - 1] = 1.0
    return v


class SeatQNet(nn.Module):
    def __init__(self, obs_dim, hidden=512):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(obs_dim + ACT_DIM, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, obs, act):
        return self.mlp(torch.cat([obs, act], -1)).squeeze(-1)


class DMCModel(nn.Module):
    def __init__(self, obs_dims):
        super().__init__()
        self.seats = nn.ModuleDict({p: SeatQNet(d) for p, d in zip(POSITIONS, obs_dims)})

    def forward(self, position, obs, act):
        return self.seats[position](obs, act)


@torch.no_grad()
def choose(model, position, obs, legal, eps, device):
    if random.random() < eps:
        return random.randrange(len(legal))
    o = torch.from_numpy(obs).float().to(device).expand(len(legal), -1)
    a = torch.from_numpy(np.stack([action_features(x) for x in legal])).to(device)
    return int(model(position, o, a).argmax())


def run_episode(env, model, eps, device):
    state, pid = env.reset()
    traj = {p: [] for p in range(3)}
    while not env.is_over():
        legal_ids = list(state["legal_actions"].keys())
        legal_raw = state["raw_legal_actions"]
        pos = POSITIONS[pid]
        j = choose(model, pos, state["obs"], legal_raw, eps, device)
        traj[pid].append((state["obs"].astype(np.float32), action_features(legal_raw[j])))
        state, pid = env.step(legal_ids[j])
    payoffs = env.get_payoffs()
    return traj, payoffs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--savedir", default="runs/dmc")
    ap.add_argument("--total-iters", type=int, default=200_000)
    ap.add_argument("--episodes-per-iter", type=int, default=8)
    ap.add_argument("--buffer", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eps", type=float, default=0.01)
    ap.add_argument("--warmup-iters", type=int, default=50)
    ap.add_argument("--save-every-min", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    env = rlcard.make("doudizhu", config={"seed": args.seed * 1000 + rank})
    obs_dims = [s[0] for s in env.state_shape]
    net = DMCModel(obs_dims).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.RMSprop(model.parameters(), lr=args.lr, alpha=0.99, eps=1e-5, momentum=0)
    buffers = {p: deque(maxlen=args.buffer) for p in POSITIONS}
    ckpt = os.path.join(args.savedir, "model.tar")
    start = 0
    if os.path.exists(ckpt):
        ck = torch.load(ckpt, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["iter"]
    if rank == 0:
        os.makedirs(args.savedir, exist_ok=True)
    last_save = time.time()
    wins = deque(maxlen=2000)

    for it in range(start, args.total_iters):
        net.eval()
        for _ in range(args.episodes_per_iter):
            traj, payoffs = run_episode(env, net, args.eps, device)
            for pid, steps in traj.items():
                for obs, act in steps:
                    buffers[POSITIONS[pid]].append((obs, act, float(payoffs[pid])))
            wins.append(float(payoffs[0] > 0))
        if it < args.warmup_iters:
            continue

        model.train()
        losses = torch.zeros(len(POSITIONS), device=device)
        for k, pos in enumerate(POSITIONS):
            batch = random.sample(buffers[pos], min(args.batch, len(buffers[pos])))
            obs = torch.from_numpy(np.stack([b[0] for b in batch])).to(device)
            act = torch.from_numpy(np.stack([b[1] for b in batch])).to(device)
            ret = torch.tensor([b[2] for b in batch], device=device)
            q = model(pos, obs, act)
            loss = ((q - ret) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 40.0)
            opt.step()
            losses[k] = loss.detach()

        if it % 200 == 0:
            stat = torch.cat([losses, torch.tensor([float(np.mean(wins))], device=device)])
            dist.all_reduce(stat)
            stat /= world
            if rank == 0:
                print(f"iter {it} | " + " ".join(f"{p} {stat[i]:.4f}" for i, p in enumerate(POSITIONS))
                      + f" | landlord win rate {stat[-1]:.3f}", flush=True)
        if (time.time() - last_save) / 60 > args.save_every_min:
            if rank == 0:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "iter": it + 1}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            last_save = time.time()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
