"""
Soft Actor-Critic for continuous control, data parallel across GPUs.

Every process owns a few MuJoCo environments and its own replay buffer.
Actor and twin critic are wrapped separately in DDP; the entropy temperature
is a plain parameter that we all-reduce by hand.

Usage:
    torchrun --nproc_per_node=4 04_sac_mujoco_ddp.py --env HalfCheetah-v4 --save-dir /shared/ckpt/sac_hc
"""
import argparse
import os
import time
from dataclasses import dataclass, asdict

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

LOG_STD_MIN, LOG_STD_MAX = -5, 2


@dataclass
class Config:
    env: str = "HalfCheetah-v4"
    seed: int = 0
    num_envs: int = 2
    total_steps: int = 1_000_000
    learning_starts: int = 5_000
    buffer_size: int = 1_000_000
    batch_size: int = 256
    gamma: float = 0.99
    tau: float = 0.005
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    policy_freq: int = 2
    autotune: bool = True
    alpha: float = 0.2
    save_dir: str = "ckpt/sac"
    save_every: int = 50_000
    resume: bool = False


def parse_config():
    parser = argparse.ArgumentParser()
    for name, default in asdict(Config()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
    return Config(**vars(parser.parse_args()))


class ReplayBuffer:
    def __init__(self, size, obs_dim, act_dim):
        self.obs = np.zeros((size, obs_dim), dtype=np.float32)
        self.next_obs = np.zeros((size, obs_dim), dtype=np.float32)
        self.act = np.zeros((size, act_dim), dtype=np.float32)
        self.rew = np.zeros(size, dtype=np.float32)
        self.done = np.zeros(size, dtype=np.float32)
        self.size, self.max_size, self.ptr = 0, size, 0

    def add(self, o, a, r, o2, d):
        for i in range(o.shape[0]):
            self.obs[self.ptr], self.act[self.ptr], self.rew[self.ptr] = o[i], a[i], r[i]
            self.next_obs[self.ptr], self.done[self.ptr] = o2[i], d[i]
            self.ptr = (self.ptr + 1) % self.max_size
            self.size = min(self.size + 1, self.max_size)

    def sample(self, n, device):
        idx = np.random.randint(0, self.size, size=n)
        as_t = lambda x: torch.as_tensor(x[idx], device=device)
        return as_t(self.obs), as_t(self.act), as_t(self.rew), as_t(self.next_obs), as_t(self.done)


class TwinQ(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden=256):
        super().__init__()
        def mlp():
            return nn.Sequential(nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.q1, self.q2 = mlp(), mlp()

    def forward(self, obs, act):
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class Actor(nn.Module):
    def __init__(self, obs_dim, act_dim, action_low, action_high, hidden=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean = nn.Linear(hidden, act_dim)
        self.log_std = nn.Linear(hidden, act_dim)
        self.register_buffer("scale", torch.tensor((action_high - action_low) / 2.0, dtype=torch.float32))
        self.register_buffer("bias", torch.tensor((action_high + action_low) / 2.0, dtype=torch.float32))

    def forward(self, obs):
        h = self.net(obs)
        mean = self.mean(h)
        log_std = torch.tanh(self.log_std(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        normal = torch.distributions.Normal(mean, log_std.exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.scale + self.bias
        log_prob = normal.log_prob(x_t) - torch.log(self.scale * (1 - y_t.pow(2)) + 1e-6)
        return action, log_prob.sum(-1), torch.tanh(mean) * self.scale + self.bias


def save_checkpoint(cfg, step, actor, critic, critic_target, log_alpha, opts):
    os.makedirs(cfg.save_dir, exist_ok=True)
    path = os.path.join(cfg.save_dir, "sac_latest.pt")
    torch.save({
        "step": step,
        "actor": actor.module.state_dict(),
        "critic": critic.module.state_dict(),
        "critic_target": critic_target.state_dict(),
        "log_alpha": log_alpha.detach().cpu(),
        "opts": [o.state_dict() for o in opts],
        "config": asdict(cfg),
    }, path)


def main():
    cfg = parse_config()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    seed = cfg.seed + 7919 * rank
    np.random.seed(seed)
    torch.manual_seed(seed)

    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(cfg.env)) for _ in range(cfg.num_envs)])
    envs.single_action_space.seed(seed)
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]
    low, high = envs.single_action_space.low, envs.single_action_space.high

    actor = DDP(Actor(obs_dim, act_dim, low, high).to(device), device_ids=[local_rank])
    critic = DDP(TwinQ(obs_dim, act_dim).to(device), device_ids=[local_rank])
    critic_target = TwinQ(obs_dim, act_dim).to(device)
    critic_target.load_state_dict(critic.module.state_dict())
    for p in critic_target.parameters():
        p.requires_grad_(False)

    actor_opt = torch.optim.Adam(actor.parameters(), lr=cfg.actor_lr)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr)
    target_entropy = -float(act_dim)
    log_alpha = torch.zeros(1, device=device, requires_grad=True)
    alpha_opt = torch.optim.Adam([log_alpha], lr=cfg.critic_lr)
    alpha = log_alpha.exp().item() if cfg.autotune else cfg.alpha

    start_step = 0
    ckpt_path = os.path.join(cfg.save_dir, "sac_latest.pt")
    if cfg.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        actor.module.load_state_dict(ckpt["actor"])
        critic.module.load_state_dict(ckpt["critic"])
        critic_target.load_state_dict(ckpt["critic_target"])
        with torch.no_grad():
            log_alpha.copy_(ckpt["log_alpha"].to(device))
        for o, sd in zip([actor_opt, critic_opt, alpha_opt], ckpt["opts"]):
            o.load_state_dict(sd)
        start_step = ckpt["step"]
        alpha = log_alpha.exp().item() if cfg.autotune else cfg.alpha

    rb = ReplayBuffer(cfg.buffer_size // world, obs_dim, act_dim)
    obs, _ = envs.reset(seed=seed)
    returns = []
    t0 = time.time()

    for step in range(start_step, cfg.total_steps, cfg.num_envs):
        if step < cfg.learning_starts:
            act = np.stack([envs.single_action_space.sample() for _ in range(cfg.num_envs)])
        else:
            with torch.no_grad():
                act, _, _ = actor.module(torch.as_tensor(obs, dtype=torch.float32, device=device))
                act = act.cpu().numpy()
        next_obs, rew, term, trunc, infos = envs.step(act)
        real_next = next_obs.copy()
        if "final_observation" in infos:
            for i, d in enumerate(infos["_final_observation"]):
                if d:
                    real_next[i] = infos["final_observation"][i]
                    returns.append(infos["final_info"][i]["episode"]["r"])
        rb.add(obs, act, rew, real_next, term)
        obs = next_obs

        if step < cfg.learning_starts:
            continue

        o, a, r, o2, d = rb.sample(cfg.batch_size, device)
        with torch.no_grad():
            a2, logp2, _ = actor.module(o2)
            q1_t, q2_t = critic_target(o2, a2)
            target = r + cfg.gamma * (1 - d) * (torch.min(q1_t, q2_t) - alpha * logp2)
        q1, q2 = critic(o, a)
        critic_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
        critic_opt.zero_grad(set_to_none=True)
        critic_loss.backward()
        critic_opt.step()

        if (step // cfg.num_envs) % cfg.policy_freq == 0:
            for _ in range(cfg.policy_freq):
                pi, logp, _ = actor(o)
                for p in critic.module.parameters():
                    p.requires_grad_(False)
                q1_pi, q2_pi = critic.module(o, pi)
                for p in critic.module.parameters():
                    p.requires_grad_(True)
                actor_loss = (alpha * logp - torch.min(q1_pi, q2_pi)).mean()
                actor_opt.zero_grad(set_to_none=True)
                actor_loss.backward()
                actor_opt.step()

                if cfg.autotune:
                    alpha_loss = -(log_alpha.exp() * (logp.detach() + target_entropy)).mean()
                    alpha_opt.zero_grad(set_to_none=True)
                    alpha_loss.backward()
                    dist.all_reduce(log_alpha.grad, op=dist.ReduceOp.SUM)
                    log_alpha.grad /= world
                    alpha_opt.step()
                    alpha = log_alpha.exp().item()

        with torch.no_grad():
            for p, tp in zip(critic.module.parameters(), critic_target.parameters()):
                tp.mul_(1 - cfg.tau).add_(p, alpha=cfg.tau)

        if (step // cfg.num_envs) % 1000 == 0:
            stats = torch.tensor([critic_loss.item(), float(sum(returns)), float(len(returns))], device=device)
            dist.all_reduce(stats)
            returns.clear()
            if rank == 0:
                ret = (stats[1] / stats[2]).item() if stats[2] > 0 else float("nan")
                print(f"step {step * world} critic {stats[0].item() / world:.3f} return {ret:.1f} "
                      f"alpha {alpha:.3f} sps {int((step - start_step) * world / (time.time() - t0))}")

        if step > 0 and step % cfg.save_every == 0:
            save_checkpoint(cfg, step, actor, critic, critic_target, log_alpha,
                            [actor_opt, critic_opt, alpha_opt])

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
