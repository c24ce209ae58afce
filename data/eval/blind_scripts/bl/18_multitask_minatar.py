"""
Multi-task actor-critic on MinAtar: each GPU plays one game, one shared
network is trained on all games at once (gradients averaged by DDP).

    torchrun --nproc_per_node=5 18_multitask_minatar.py \
        --games breakout asterix freeway seaquest space_invaders
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from minatar import Environment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--games", nargs="+", default=["breakout", "asterix", "freeway", "seaquest", "space_invaders"])
    p.add_argument("--envs-per-rank", type=int, default=32)
    p.add_argument("--unroll", type=int, default=20)
    p.add_argument("--updates", type=int, default=100_000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--ent", type=float, default=0.01)
    p.add_argument("--vf", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logdir", default="runs/minatar_mt")
    p.add_argument("--save-every", type=int, default=5_000)
    return p.parse_args()


class VecMinAtar:
    """Minimal batched wrapper around a list of MinAtar environments."""

    def __init__(self, game, n, seed):
        self.envs = [Environment(game, sticky_action_prob=0.1, random_seed=seed + i) for i in range(n)]
        self.n_actions = self.envs[0].num_actions()
        self.shape = self.envs[0].state_shape()
        self.ep_ret = np.zeros(n)
        for e in self.envs:
            e.reset()

    def observe(self):
        # (n, H, W, C) bool -> (n, C, H, W) float
        return np.stack([e.state() for e in self.envs]).transpose(0, 3, 1, 2).astype(np.float32)

    def step(self, actions):
        rews, dones, finished = np.zeros(len(self.envs)), np.zeros(len(self.envs)), []
        for i, (e, a) in enumerate(zip(self.envs, actions)):
            r, done = e.act(int(a))
            self.ep_ret[i] += r
            rews[i], dones[i] = r, float(done)
            if done:
                finished.append(self.ep_ret[i])
                self.ep_ret[i] = 0.0
                e.reset()
        return self.observe(), rews, dones, finished


class MinAtarNet(nn.Module):
    def __init__(self, in_channels, n_actions):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 16, kernel_size=3, stride=1)
        self.fc = nn.Linear(16 * 8 * 8, 256)
        self.pi = nn.Linear(256, n_actions)
        self.v = nn.Linear(256, 1)

    def forward(self, x):
        h = F.relu(self.conv(x))
        h = F.relu(self.fc(h.flatten(1)))
        return self.pi(h), self.v(h).squeeze(-1)


def gae(rew, val, done, last_val, gamma, lam):
    T = rew.shape[0]
    adv = torch.zeros_like(rew)
    running = torch.zeros_like(last_val)
    for t in reversed(range(T)):
        nv = last_val if t == T - 1 else val[t + 1]
        nonterm = 1.0 - done[t]
        delta = rew[t] + gamma * nv * nonterm - val[t]
        running = delta + gamma * lam * nonterm * running
        adv[t] = running
    return adv, adv + val


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    game = args.games[rank % len(args.games)]
    env = VecMinAtar(game, args.envs_per_rank, seed=args.seed + 1000 * rank)
    in_channels = env.shape[2]

    model = MinAtarNet(in_channels, env.n_actions).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    writer = SummaryWriter(args.logdir) if rank == 0 else None
    print(f"[rank {rank}] game={game} channels={in_channels} actions={env.n_actions}", flush=True)

    obs = torch.as_tensor(env.observe(), device=device)
    recent = []
    tic = time.time()
    for update in range(1, args.updates + 1):
        obs_l, act_l, rew_l, done_l, val_l = [], [], [], [], []
        for _ in range(args.unroll):
            with torch.no_grad():
                logits, v = model.module(obs)
            a = torch.distributions.Categorical(logits=logits).sample()
            nobs, r, d, fin = env.step(a.cpu().numpy())
            recent.extend(fin)
            obs_l.append(obs)
            act_l.append(a)
            val_l.append(v)
            rew_l.append(torch.as_tensor(r, dtype=torch.float32, device=device))
            done_l.append(torch.as_tensor(d, dtype=torch.float32, device=device))
            obs = torch.as_tensor(nobs, device=device)
        with torch.no_grad():
            _, last_v = model.module(obs)
            adv, ret = gae(torch.stack(rew_l), torch.stack(val_l), torch.stack(done_l), last_v,
                           args.gamma, args.lam)

        logits, values = model(torch.cat(obs_l))
        pd = torch.distributions.Categorical(logits=logits)
        logp = pd.log_prob(torch.cat(act_l))
        adv, ret = adv.reshape(-1), ret.reshape(-1)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        loss = -(logp * adv).mean() + args.vf * F.mse_loss(values, ret) - args.ent * pd.entropy().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

        if update % 250 == 0:
            # per-game return: gather (sum, count) from every rank
            local = torch.tensor([float(sum(recent)), float(len(recent))], device=device)
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            recent.clear()
            if rank == 0:
                frames = update * args.unroll * args.envs_per_rank * world
                for r_, g in enumerate(gathered):
                    name = args.games[r_ % len(args.games)]
                    if g[1] > 0:
                        writer.add_scalar(f"return/{name}", (g[0] / g[1]).item(), frames)
                writer.add_scalar("loss/total", loss.item(), frames)
                print(f"update {update} frames {frames} fps {frames / (time.time() - tic):.0f}", flush=True)

        if update % args.save_every == 0 and rank == 0:
            os.makedirs(args.logdir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "update": update,
                        "games": args.games}, os.path.join(args.logdir, f"mt_{update}.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
