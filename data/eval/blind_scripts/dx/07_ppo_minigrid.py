"""Distributed PPO on MiniGrid (partially observable gridworlds).

Usage:
    torchrun --nproc_per_node=4 ppo_minigrid.py --env MiniGrid-DoorKey-8x8-v0 --frames 20000000
"""
import argparse
import os
import time

import gymnasium as gym
import minigrid  # noqa: F401  (registers the MiniGrid-* environments)
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from minigrid.wrappers import ImgObsWrapper
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="MiniGrid-DoorKey-8x8-v0")
    p.add_argument("--procs", type=int, default=16, help="environments per GPU")
    p.add_argument("--frames-per-proc", type=int, default=128)
    p.add_argument("--frames", type=int, default=20_000_000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--discount", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--value-loss-coef", type=float, default=0.5)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--save-interval", type=int, default=100)
    p.add_argument("--model-dir", default="storage/doorkey")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class ACModel(nn.Module):
    def __init__(self, obs_shape, n_actions):
        super().__init__()
        h, w, c = obs_shape
        self.image_conv = nn.Sequential(
            nn.Conv2d(c, 16, 2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 2), nn.ReLU(),
            nn.Conv2d(32, 64, 2), nn.ReLU(),
        )
        emb = ((h - 1) // 2 - 2) * ((w - 1) // 2 - 2) * 64
        self.actor = nn.Sequential(nn.Linear(emb, 64), nn.Tanh(), nn.Linear(64, n_actions))
        self.critic = nn.Sequential(nn.Linear(emb, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, obs):
        x = self.image_conv(obs.permute(0, 3, 1, 2).float())
        x = x.flatten(1)
        return torch.distributions.Categorical(logits=self.actor(x)), self.critic(x).squeeze(1)


class PPOTrainer:
    def __init__(self, args, rank, world, device):
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.envs = gym.vector.SyncVectorEnv([
            self._env_fn(args.env, args.seed + 10_000 * rank + i) for i in range(args.procs)
        ])
        obs_shape = self.envs.single_observation_space.shape
        torch.manual_seed(args.seed)
        model = ACModel(obs_shape, self.envs.single_action_space.n).to(device)
        self.model = DDP(model, device_ids=[device.index])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, eps=1e-8)
        torch.manual_seed(args.seed + rank)
        self.obs, _ = self.envs.reset(seed=args.seed + 10_000 * rank)
        self.ep_return = np.zeros(args.procs)
        self.ep_len = np.zeros(args.procs, dtype=np.int64)
        self.done_returns, self.done_lengths = [], []

    @staticmethod
    def _env_fn(name, seed):
        def thunk():
            env = ImgObsWrapper(gym.make(name))
            env.reset(seed=seed)
            return env
        return thunk

    @torch.no_grad()
    def collect(self):
        a, T, N = self.args, self.args.frames_per_proc, self.args.procs
        obs_buf = torch.zeros((T, N) + self.envs.single_observation_space.shape, dtype=torch.uint8, device=self.device)
        act_buf = torch.zeros(T, N, dtype=torch.long, device=self.device)
        logp_buf = torch.zeros(T, N, device=self.device)
        val_buf = torch.zeros(T, N, device=self.device)
        rew_buf = torch.zeros(T, N, device=self.device)
        mask_buf = torch.zeros(T, N, device=self.device)

        for t in range(T):
            obs = torch.as_tensor(self.obs, device=self.device)
            dist_, value = self.model.module(obs)
            action = dist_.sample()
            self.obs, reward, term, trunc, _ = self.envs.step(action.cpu().numpy())
            done = np.logical_or(term, trunc)
            obs_buf[t], act_buf[t], logp_buf[t], val_buf[t] = obs, action, dist_.log_prob(action), value
            rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32, device=self.device)
            mask_buf[t] = torch.as_tensor(1.0 - done, dtype=torch.float32, device=self.device)
            self.ep_return += reward
            self.ep_len += 1
            for i in np.flatnonzero(done):
                self.done_returns.append(self.ep_return[i])
                self.done_lengths.append(self.ep_len[i])
                self.ep_return[i], self.ep_len[i] = 0.0, 0

        _, next_value = self.model.module(torch.as_tensor(self.obs, device=self.device))
        adv_buf = torch.zeros(T, N, device=self.device)
        gae = torch.zeros(N, device=self.device)
        for t in reversed(range(T)):
            nv = next_value if t == T - 1 else val_buf[t + 1]
            delta = rew_buf[t] + a.discount * nv * mask_buf[t] - val_buf[t]
            gae = delta + a.discount * a.gae_lambda * mask_buf[t] * gae
            adv_buf[t] = gae
        ret_buf = adv_buf + val_buf
        flat = lambda x: x.reshape(T * N, *x.shape[2:])
        return {k: flat(v) for k, v in dict(obs=obs_buf, act=act_buf, logp=logp_buf, val=val_buf,
                                            adv=adv_buf, ret=ret_buf).items()}

    def update(self, exps):
        a = self.args
        n = exps["obs"].shape[0]
        logs = []
        for _ in range(a.epochs):
            perm = torch.randperm(n, device=self.device)
            for start in range(0, n, a.batch_size):
                idx = perm[start:start + a.batch_size]
                dist_, value = self.model(exps["obs"][idx])
                adv = exps["adv"][idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                ratio = torch.exp(dist_.log_prob(exps["act"][idx]) - exps["logp"][idx])
                policy_loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - a.clip_eps, 1 + a.clip_eps) * adv).mean()
                v_clipped = exps["val"][idx] + torch.clamp(value - exps["val"][idx], -a.clip_eps, a.clip_eps)
                value_loss = torch.max((value - exps["ret"][idx]).pow(2), (v_clipped - exps["ret"][idx]).pow(2)).mean()
                entropy = dist_.entropy().mean()
                loss = policy_loss - a.entropy_coef * entropy + a.value_loss_coef * value_loss
                self.optimizer.zero_grad()
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
                self.optimizer.step()
                logs.append((policy_loss.item(), value_loss.item(), entropy.item(), grad_norm.item()))
        return np.mean(logs, axis=0)

    def episode_stats(self):
        stats = torch.tensor([float(np.sum(self.done_returns)), float(len(self.done_returns)),
                              float(np.sum(self.done_lengths))], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        self.done_returns, self.done_lengths = [], []
        n = max(stats[1].item(), 1.0)
        return stats[0].item() / n, stats[2].item() / n, int(stats[1].item())

    def save(self, num_frames, update):
        if self.rank != 0:
            return
        os.makedirs(self.args.model_dir, exist_ok=True)
        torch.save({"num_frames": num_frames, "update": update,
                    "model_state": self.model.module.state_dict(),
                    "optimizer_state": self.optimizer.state_dict()},
                   os.path.join(self.args.model_dir, "status.pt"))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed + rank)

    trainer = PPOTrainer(args, rank, world, device)
    frames_per_update = args.frames_per_proc * args.procs * world
    num_frames, update, t0 = 0, 0, time.time()
    while num_frames < args.frames:
        exps = trainer.collect()
        pl, vl, ent, gn = trainer.update(exps)
        num_frames += frames_per_update
        update += 1

        if update % args.log_interval == 0:
            mean_ret, mean_len, n_eps = trainer.episode_stats()
            if rank == 0:
                fps = num_frames / (time.time() - t0)
                print(f"U {update} | F {num_frames:08d} | FPS {fps:5.0f} | R {mean_ret:.3f} | "
                      f"len {mean_len:.1f} | eps {n_eps} | pL {pl:.3f} | vL {vl:.3f} | H {ent:.3f} | gN {gn:.3f}",
                      flush=True)
        if update % args.save_interval == 0:
            trainer.save(num_frames, update)

    trainer.save(num_frames, update)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
