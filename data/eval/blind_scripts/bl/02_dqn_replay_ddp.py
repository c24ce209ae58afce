#!/usr/bin/env python
# Double DQN on Atari, data-parallel over GPUs.
#
# Each rank runs its own actors and keeps its own replay buffer; the online
# Q-network is wrapped in DDP so the TD gradients are averaged across ranks.
#
#   torchrun --nproc_per_node=8 02_dqn_replay_ddp.py --env-id ALE/Breakout-v5
import argparse
import os
import random
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import wandb
except ImportError:
    wandb = None


def get_args():
    parser = argparse.ArgumentParser(description="distributed double DQN")
    parser.add_argument("--env-id", default="ALE/Breakout-v5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--total-steps", type=int, default=10_000_000, help="env steps per rank")
    parser.add_argument("--buffer-size", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--learning-starts", type=int, default=20_000)
    parser.add_argument("--train-freq", type=int, default=4)
    parser.add_argument("--target-update", type=int, default=2_000)
    parser.add_argument("--eps-start", type=float, default=1.0)
    parser.add_argument("--eps-end", type=float, default=0.01)
    parser.add_argument("--eps-decay-frac", type=float, default=0.1)
    parser.add_argument("--out-dir", default="runs/dqn")
    parser.add_argument("--ckpt-every", type=int, default=250_000)
    parser.add_argument("--wandb-project", default=None)
    return parser.parse_args()


class ReplayBuffer:
    """Uniform replay stored as uint8 on the GPU to avoid host->device copies."""

    def __init__(self, capacity, obs_shape, device="cuda:0"):
        self.capacity = capacity
        self.device = device
        self.obs = torch.zeros((capacity, *obs_shape), dtype=torch.uint8, device=device)
        self.next_obs = torch.zeros((capacity, *obs_shape), dtype=torch.uint8, device=device)
        self.actions = torch.zeros(capacity, dtype=torch.long, device=device)
        self.rewards = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.dones = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.ptr = 0
        self.size = 0

    def add_batch(self, obs, next_obs, actions, rewards, dones):
        n = obs.shape[0]
        idx = (torch.arange(n) + self.ptr) % self.capacity
        idx = idx.to(self.device)
        self.obs[idx] = torch.as_tensor(obs, device=self.device)
        self.next_obs[idx] = torch.as_tensor(next_obs, device=self.device)
        self.actions[idx] = torch.as_tensor(actions, device=self.device)
        self.rewards[idx] = torch.as_tensor(rewards, dtype=torch.float32, device=self.device)
        self.dones[idx] = torch.as_tensor(dones, dtype=torch.float32, device=self.device)
        self.ptr = (self.ptr + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size):
        idx = torch.randint(0, self.size, (batch_size,), device=self.device)
        return (self.obs[idx].float() / 255.0, self.actions[idx], self.rewards[idx],
                self.next_obs[idx].float() / 255.0, self.dones[idx])


class QNetwork(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, n_actions))

    def forward(self, x):
        return self.head(self.conv(x))


def make_env(env_id, seed):
    def thunk():
        env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84,
                                              terminal_on_life_loss=False, grayscale_obs=True)
        env = gym.wrappers.FrameStack(env, 4)
        env.action_space.seed(seed)
        return env
    return thunk


def linear_schedule(start, end, duration, t):
    return max(end, start + (end - start) * t / duration)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    seed = args.seed + rank * 10_000
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    if is_main and args.wandb_project and wandb is not None:
        wandb.init(project=args.wandb_project, config=vars(args), name=f"dqn-{args.env_id}-{world}gpu")

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, seed + i) for i in range(args.num_envs)])
    n_actions = envs.single_action_space.n

    q_net = QNetwork(n_actions).to(device)
    q_net = DDP(q_net, device_ids=[local_rank])
    target_net = QNetwork(n_actions).to(device)
    target_net.load_state_dict(q_net.module.state_dict())
    target_net.eval()
    optimizer = torch.optim.Adam(q_net.parameters(), lr=args.lr, eps=1.5e-4)

    rb = ReplayBuffer(args.buffer_size // world, envs.single_observation_space.shape)

    obs, _ = envs.reset(seed=seed)
    episode_returns = []
    t0 = time.time()
    n_iters = args.total_steps // args.num_envs
    for it in range(n_iters):
        step = it * args.num_envs
        eps = linear_schedule(args.eps_start, args.eps_end, args.eps_decay_frac * args.total_steps, step)
        if random.random() < eps:
            actions = np.array([envs.single_action_space.sample() for _ in range(args.num_envs)])
        else:
            with torch.no_grad():
                x = torch.as_tensor(np.asarray(obs), device=device).float() / 255.0
                actions = q_net.module(x).argmax(dim=1).cpu().numpy()

        next_obs, rewards, terms, truncs, infos = envs.step(actions)
        real_next = np.array(next_obs, copy=True)
        if "final_observation" in infos:
            for i, done in enumerate(infos["_final_observation"]):
                if done:
                    real_next[i] = np.asarray(infos["final_observation"][i])
        if "final_info" in infos:
            for info in infos["final_info"]:
                if info and "episode" in info:
                    episode_returns.append(float(info["episode"]["r"]))
        rb.add_batch(np.asarray(obs), real_next, actions, np.sign(rewards), terms)
        obs = next_obs

        if step >= args.learning_starts and it % args.train_freq == 0:
            s, a, r, s2, d = rb.sample(args.batch_size)
            with torch.no_grad():
                next_a = q_net.module(s2).argmax(dim=1, keepdim=True)
                next_q = target_net(s2).gather(1, next_a).squeeze(1)
                td_target = r + args.gamma * next_q * (1.0 - d)
            q = q_net(s).gather(1, a.unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(q, td_target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(q_net.parameters(), 10.0)
            optimizer.step()

            if it % 1000 == 0:
                stats = torch.tensor([loss.item(), q.mean().item(),
                                      float(sum(episode_returns)), float(len(episode_returns))], device=device)
                dist.all_reduce(stats)
                episode_returns.clear()
                if is_main:
                    mean_ret = (stats[2] / stats[3]).item() if stats[3] > 0 else float("nan")
                    sps = int(step * world / (time.time() - t0))
                    print(f"[{step * world}] loss {stats[0].item() / world:.4f} q {stats[1].item() / world:.2f} "
                          f"ret {mean_ret:.1f} eps {eps:.3f} sps {sps}")
                    if wandb is not None and wandb.run is not None:
                        wandb.log({"loss": stats[0].item() / world, "q": stats[1].item() / world,
                                   "episode_return": mean_ret, "eps": eps, "sps": sps}, step=step * world)

        if it % (args.target_update // args.num_envs) == 0:
            target_net.load_state_dict(q_net.module.state_dict())

        if step > 0 and step % args.ckpt_every == 0:
            if is_main:
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save({"q_net": q_net.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "step": step}, os.path.join(args.out_dir, f"dqn_{step * world}.pt"))
            dist.barrier()

    envs.close()
    if is_main and wandb is not None and wandb.run is not None:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
