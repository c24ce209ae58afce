"""
Dueling double-DQN with n-step returns on Atari (envpool), multi-GPU data parallel.

Launch:
    torchrun --nnodes=1 --nproc_per_node=4 09_dqn_atari_localrank.py --env Pong-v5 --n-step 3
"""
import argparse
import collections
import os
import random
import time

import envpool
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--env", default="Pong-v5")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--frames", type=int, default=20_000_000, help="per process")
    parser.add_argument("--buffer", type=int, default=250_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--n-step", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lr", type=float, default=6.25e-5)
    parser.add_argument("--warmup", type=int, default=50_000)
    parser.add_argument("--replay-ratio", type=int, default=1, help="gradient steps per env step batch")
    parser.add_argument("--sync-target", type=int, default=8_000)
    parser.add_argument("--eval-interval", type=int, default=250_000)
    parser.add_argument("--output", default="outputs/dqn")
    return parser.parse_args()


class DuelingQ(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
        self.value = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, 1))
        self.adv = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, n_actions))

    def forward(self, x):
        h = self.features(x.float() / 255.0)
        a = self.adv(h)
        return self.value(h) + a - a.mean(dim=1, keepdim=True)


class NStepReplay:
    def __init__(self, capacity, num_envs, n_step, gamma, obs_shape):
        self.capacity, self.n_step, self.gamma = capacity, n_step, gamma
        self.obs = np.zeros((capacity, *obs_shape), dtype=np.uint8)
        self.next_obs = np.zeros((capacity, *obs_shape), dtype=np.uint8)
        self.act = np.zeros(capacity, dtype=np.int64)
        self.ret = np.zeros(capacity, dtype=np.float32)
        self.disc = np.zeros(capacity, dtype=np.float32)
        self.pending = [collections.deque() for _ in range(num_envs)]
        self.idx, self.full = 0, False

    def _write(self, o, a, r, o2, d):
        self.obs[self.idx], self.act[self.idx], self.ret[self.idx] = o, a, r
        self.next_obs[self.idx], self.disc[self.idx] = o2, d
        self.idx = (self.idx + 1) % self.capacity
        self.full = self.full or self.idx == 0

    def add(self, obs, act, rew, next_obs, term, trunc):
        for e in range(len(obs)):
            q = self.pending[e]
            q.append((obs[e], act[e], rew[e]))
            if len(q) == self.n_step or term[e] or trunc[e]:
                while q:
                    ret = sum(t[2] * self.gamma ** k for k, t in enumerate(q))
                    disc = 0.0 if term[e] else self.gamma ** len(q)
                    self._write(q[0][0], q[0][1], ret, next_obs[e], disc)
                    q.popleft()
                    if not (term[e] or trunc[e]):
                        break

    def __len__(self):
        return self.capacity if self.full else self.idx

    def sample(self, n, device):
        i = np.random.randint(0, len(self), n)
        t = lambda x: torch.from_numpy(x[i]).to(device, non_blocking=True)
        return t(self.obs), t(self.act), t(self.ret), t(self.next_obs), t(self.disc)


@torch.no_grad()
def evaluate(q_net, env_name, device, episodes=10, seed=10_000):
    env = envpool.make(env_name, env_type="gymnasium", num_envs=1, seed=seed, episodic_life=False,
                       reward_clip=False)
    scores = []
    obs, _ = env.reset()
    score = 0.0
    while len(scores) < episodes:
        if random.random() < 0.001:
            act = np.array([env.action_space.sample()])
        else:
            act = q_net(torch.from_numpy(obs).to(device)).argmax(1).cpu().numpy()
        obs, rew, term, trunc, _ = env.step(act)
        score += float(rew[0])
        if term[0] or trunc[0]:
            scores.append(score)
            score = 0.0
            obs, _ = env.reset()
    env.close()
    return float(np.mean(scores))


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    envs = envpool.make(args.env, env_type="gymnasium", num_envs=args.num_envs,
                        seed=args.seed + 100 * rank, episodic_life=True, reward_clip=True)
    n_actions = envs.single_action_space.n
    obs_shape = envs.single_observation_space.shape

    online = DDP(DuelingQ(n_actions).to(device), device_ids=[args.local_rank])
    target = DuelingQ(n_actions).to(device)
    target.load_state_dict(online.module.state_dict())
    opt = torch.optim.Adam(online.parameters(), lr=args.lr, eps=1.5e-4)
    replay = NStepReplay(args.buffer, args.num_envs, args.n_step, args.gamma, obs_shape)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    obs, _ = envs.reset()
    frames, updates, best = 0, 0, -float("inf")
    ep_ret = np.zeros(args.num_envs)
    finished = []
    tic = time.time()
    next_eval = args.eval_interval

    while frames < args.frames:
        eps = max(0.01, 1.0 - 0.99 * frames / 1_000_000)
        with torch.no_grad():
            greedy = online.module(torch.from_numpy(obs).to(device)).argmax(1).cpu().numpy()
        rand = np.random.randint(0, n_actions, size=args.num_envs)
        act = np.where(np.random.rand(args.num_envs) < eps, rand, greedy)
        next_obs, rew, term, trunc, info = envs.step(act)
        replay.add(obs, act, rew, next_obs, term, trunc)
        ep_ret += info["reward"]
        for e in np.nonzero(term | trunc)[0]:
            if info["lives"][e] == 0:
                finished.append(ep_ret[e])
                ep_ret[e] = 0.0
        obs = next_obs
        frames += args.num_envs

        if frames < args.warmup:
            continue

        for _ in range(args.replay_ratio):
            o, a, r, o2, disc = replay.sample(args.batch_size, device)
            with torch.no_grad():
                a2 = online.module(o2).argmax(1, keepdim=True)
                y = r + disc * target(o2).gather(1, a2).squeeze(1)
            q = online(o).gather(1, a.unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(q, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(online.parameters(), 10.0)
            opt.step()
            updates += 1
            if updates % args.sync_target == 0:
                target.load_state_dict(online.module.state_dict())

        if frames >= next_eval:
            next_eval += args.eval_interval
            s = torch.tensor([float(sum(finished)), float(len(finished)), loss.item()], device=device)
            dist.all_reduce(s)
            finished.clear()
            if rank == 0:
                score = evaluate(online.module, args.env, device)
                train_ret = (s[0] / s[1]).item() if s[1] > 0 else float("nan")
                print(f"frames {frames * world} updates {updates} train_return {train_ret:.1f} "
                      f"eval {score:.1f} loss {s[2].item() / world:.4f} fps {frames * world / (time.time() - tic):.0f}",
                      flush=True)
                torch.save(online.module.state_dict(), os.path.join(args.output, "last.pt"))
                if score > best:
                    best = score
                    torch.save(online.module.state_dict(), os.path.join(args.output, "best.pt"))
            dist.barrier()

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
