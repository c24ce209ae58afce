"""Synchronous A2C on MiniGrid navigation tasks, one process per GPU.

    torchrun --nproc_per_node=4 a2c_gridworld.py --env MiniGrid-FourRooms-v0 --num-frames 50000000
"""
import argparse
import os
import time
from collections import deque

import gymnasium as gym
import minigrid  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from minigrid.wrappers import ImgObsWrapper
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description="A2C gridworld")
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--env", default="MiniGrid-FourRooms-v0")
parser.add_argument("--num-processes", type=int, default=32, help="envs per GPU")
parser.add_argument("--num-steps", type=int, default=5)
parser.add_argument("--num-frames", type=int, default=50_000_000)
parser.add_argument("--lr", type=float, default=7e-4)
parser.add_argument("--alpha", type=float, default=0.99, help="RMSprop alpha")
parser.add_argument("--eps", type=float, default=1e-5)
parser.add_argument("--gamma", type=float, default=0.99)
parser.add_argument("--entropy-coef", type=float, default=0.01)
parser.add_argument("--value-loss-coef", type=float, default=0.5)
parser.add_argument("--max-grad-norm", type=float, default=0.5)
parser.add_argument("--log-interval", type=int, default=100)
parser.add_argument("--save-interval", type=int, default=5000)
parser.add_argument("--save-dir", default="./trained_models/a2c")
parser.add_argument("--seed", type=int, default=1)


class GridPolicy(nn.Module):
    """Embedding of (object, colour, state) triples followed by a small conv net."""

    def __init__(self, n_actions, n_obj=11, n_col=6, n_state=3, emb=8):
        super().__init__()
        self.obj = nn.Embedding(n_obj, emb)
        self.col = nn.Embedding(n_col, emb)
        self.state = nn.Embedding(n_state, emb)
        self.conv = nn.Sequential(
            nn.Conv2d(3 * emb, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3), nn.ReLU(),
        )
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(64 * 5 * 5, 256), nn.ReLU())
        self.actor = nn.Linear(256, n_actions)
        self.critic = nn.Linear(256, 1)

    def forward(self, obs):
        obs = obs.long()
        x = torch.cat([self.obj(obs[..., 0]), self.col(obs[..., 1]), self.state(obs[..., 2])], dim=-1)
        h = self.fc(self.conv(x.permute(0, 3, 1, 2)))
        return self.actor(h), self.critic(h).squeeze(-1)


def make_env(env_id, seed):
    def _thunk():
        env = ImgObsWrapper(gym.make(env_id, max_steps=400))
        env.reset(seed=seed)
        env.action_space.seed(seed)
        return env
    return _thunk


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env, args.seed * 100_000 + rank * args.num_processes + i) for i in range(args.num_processes)]
    )
    n_actions = envs.single_action_space.n
    actor_critic = GridPolicy(n_actions).to(device)
    actor_critic = DDP(actor_critic, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.RMSprop(actor_critic.parameters(), lr=args.lr, eps=args.eps, alpha=args.alpha)
    torch.manual_seed(args.seed + rank)

    num_updates = args.num_frames // (args.num_steps * args.num_processes * world_size)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=num_updates)

    obs, _ = envs.reset()
    obs = torch.as_tensor(obs, device=device)
    ep_rewards = np.zeros(args.num_processes)
    recent = deque(maxlen=100)
    start = time.time()

    for j in range(num_updates):
        obs_seq, actions, rewards, masks = [], [], [], []
        for step in range(args.num_steps):
            with torch.no_grad():
                logits, _ = actor_critic.module(obs)
                action = torch.distributions.Categorical(logits=logits).sample()
            next_obs, reward, term, trunc, _ = envs.step(action.cpu().numpy())
            done = np.logical_or(term, trunc)
            ep_rewards += reward
            for i in np.flatnonzero(done):
                recent.append(ep_rewards[i])
                ep_rewards[i] = 0.0

            obs_seq.append(obs)
            actions.append(action)
            rewards.append(torch.as_tensor(reward, dtype=torch.float32, device=device))
            masks.append(torch.as_tensor(1.0 - done, dtype=torch.float32, device=device))
            obs = torch.as_tensor(next_obs, device=device)

        with torch.no_grad():
            _, next_value = actor_critic.module(obs)
        returns = []
        R = next_value
        for step in reversed(range(args.num_steps)):
            R = rewards[step] + args.gamma * R * masks[step]
            returns.insert(0, R)

        returns = torch.stack(returns)
        logits, values = actor_critic(torch.cat(obs_seq))
        dist_ = torch.distributions.Categorical(logits=logits)
        log_probs = dist_.log_prob(torch.cat(actions)).view(args.num_steps, -1)
        values = values.view(args.num_steps, -1)
        advantages = returns - values
        value_loss = advantages.pow(2).mean()
        action_loss = -(advantages.detach() * log_probs).mean()
        entropy = dist_.entropy().mean()
        loss = value_loss * args.value_loss_coef + action_loss - entropy * args.entropy_coef

        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(actor_critic.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()

        if j % args.log_interval == 0:
            local = torch.tensor([float(np.sum(recent)), float(len(recent))], device=device)
            dist.all_reduce(local)
            if rank == 0:
                total_frames = (j + 1) * args.num_steps * args.num_processes * world_size
                fps = int(total_frames / (time.time() - start))
                mean_r = (local[0] / local[1]).item() if local[1] > 0 else float("nan")
                print(f"Updates {j}, frames {total_frames}, FPS {fps}, mean reward (last 100/rank) {mean_r:.3f}, "
                      f"entropy {entropy.item():.3f}, value loss {value_loss.item():.4f}, "
                      f"policy loss {action_loss.item():.4f}", flush=True)

        if rank == 0 and (j % args.save_interval == 0 or j == num_updates - 1):
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": actor_critic.module.state_dict(), "optimizer": optimizer.state_dict(), "update": j},
                       os.path.join(args.save_dir, args.env + ".pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
