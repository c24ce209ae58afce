"""SAC from pixels (DrQ-style augmentation) on DeepMind Control, one learner per GPU.

Each learner process steps its own environment, fills its own replay buffer and
averages gradients with the other learners.

    MUJOCO_GL=egl python 08_sac_dmc_pixels_spawn.py --domain walker --task run --gpus 4
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from dm_control import suite
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--domain", default="walker")
    p.add_argument("--task", default="run")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--frames", type=int, default=1_000_000)
    p.add_argument("--action_repeat", type=int, default=2)
    p.add_argument("--frame_stack", type=int, default=3)
    p.add_argument("--img", type=int, default=84)
    p.add_argument("--seed_steps", type=int, default=4000)
    p.add_argument("--buffer_size", type=int, default=200_000)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.01)
    p.add_argument("--init_temp", type=float, default=0.1)
    p.add_argument("--eval_every", type=int, default=10_000)
    p.add_argument("--eval_episodes", type=int, default=10)
    p.add_argument("--logdir", default="runs/sac_pixels")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class PixelEnv:
    def __init__(self, domain, task, seed, img, stack, repeat):
        self.env = suite.load(domain, task, task_kwargs={"random": seed})
        self.img, self.stack, self.repeat = img, stack, repeat
        spec = self.env.action_spec()
        self.act_dim, self.low, self.high = spec.shape[0], spec.minimum, spec.maximum
        self.frames = []

    def _render(self):
        return self.env.physics.render(self.img, self.img, camera_id=0).transpose(2, 0, 1).copy()

    def reset(self):
        self.env.reset()
        f = self._render()
        self.frames = [f] * self.stack
        return np.concatenate(self.frames)

    def step(self, a):
        a = self.low + (a + 1.0) * 0.5 * (self.high - self.low)
        reward, ts = 0.0, None
        for _ in range(self.repeat):
            ts = self.env.step(a)
            reward += ts.reward or 0.0
            if ts.last():
                break
        self.frames = self.frames[1:] + [self._render()]
        return np.concatenate(self.frames), reward, ts.last()


class Replay:
    def __init__(self, cap, obs_shape, act_dim):
        self.obs = np.zeros((cap, *obs_shape), np.uint8)
        self.next_obs = np.zeros((cap, *obs_shape), np.uint8)
        self.act = np.zeros((cap, act_dim), np.float32)
        self.rew = np.zeros((cap, 1), np.float32)
        self.notdone = np.zeros((cap, 1), np.float32)
        self.cap, self.i, self.full = cap, 0, False

    def add(self, o, a, r, o2, done):
        self.obs[self.i], self.act[self.i], self.rew[self.i] = o, a, r
        self.next_obs[self.i], self.notdone[self.i] = o2, 1.0 - done
        self.i = (self.i + 1) % self.cap
        self.full = self.full or self.i == 0

    def sample(self, n, device):
        idx = np.random.randint(0, self.cap if self.full else self.i, size=n)
        t = lambda x, dt=torch.float32: torch.as_tensor(x[idx], device=device, dtype=dt)
        return t(self.obs), t(self.act), t(self.rew), t(self.next_obs), t(self.notdone)


def random_shift(x, pad=4):
    n, c, h, w = x.shape
    x = F.pad(x, (pad,) * 4, mode="replicate")
    eps = 1.0 / (h + 2 * pad)
    ar = torch.linspace(-1.0 + eps, 1.0 - eps, h + 2 * pad, device=x.device)[:h]
    ar = ar.unsqueeze(0).repeat(h, 1).unsqueeze(2)
    base = torch.cat([ar, ar.transpose(1, 0)], 2).unsqueeze(0).repeat(n, 1, 1, 1)
    shift = torch.randint(0, 2 * pad + 1, (n, 1, 1, 2), device=x.device, dtype=x.dtype) * 2.0 / (h + 2 * pad)
    return F.grid_sample(x, base + shift, padding_mode="zeros", align_corners=False)


class Encoder(nn.Module):
    def __init__(self, in_ch):
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(in_ch, 32, 3, 2), nn.ReLU(), nn.Conv2d(32, 32, 3, 1), nn.ReLU(),
                                   nn.Conv2d(32, 32, 3, 1), nn.ReLU(), nn.Conv2d(32, 32, 3, 1), nn.ReLU())
        self.out_dim = 32 * 35 * 35

    def forward(self, obs):
        return self.convs(obs / 255.0 - 0.5).flatten(1)


class Critic(nn.Module):
    def __init__(self, in_ch, act_dim, feat=50, hidden=1024):
        super().__init__()
        self.encoder = Encoder(in_ch)
        self.trunk = nn.Sequential(nn.Linear(self.encoder.out_dim, feat), nn.LayerNorm(feat), nn.Tanh())
        self.q1 = nn.Sequential(nn.Linear(feat + act_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.q2 = nn.Sequential(nn.Linear(feat + act_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs, act, detach_encoder=False):
        h = self.encoder(obs)
        if detach_encoder:
            h = h.detach()
        h = torch.cat([self.trunk(h), act], -1)
        return self.q1(h), self.q2(h)


class Actor(nn.Module):
    def __init__(self, in_ch, act_dim, feat=50, hidden=1024):
        super().__init__()
        self.encoder = Encoder(in_ch)
        self.trunk = nn.Sequential(nn.Linear(self.encoder.out_dim, feat), nn.LayerNorm(feat), nn.Tanh())
        self.pi = nn.Sequential(nn.Linear(feat, hidden), nn.ReLU(), nn.Linear(hidden, 2 * act_dim))

    def forward(self, obs):
        mu, log_std = self.pi(self.trunk(self.encoder(obs))).chunk(2, -1)
        log_std = -10 + 0.5 * 12 * (torch.tanh(log_std) + 1)
        eps = torch.randn_like(mu)
        u = mu + eps * log_std.exp()
        a = torch.tanh(u)
        logp = (-0.5 * eps.pow(2) - log_std - 0.5 * np.log(2 * np.pi)).sum(-1, keepdim=True)
        logp = logp - torch.log(1 - a.pow(2) + 1e-6).sum(-1, keepdim=True)
        return a, logp, torch.tanh(mu)


def learner_main(rank, world_size, cfg):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}")
    seed = cfg.seed * 100 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    env = PixelEnv(cfg.domain, cfg.task, seed, cfg.img, cfg.frame_stack, cfg.action_repeat)
    eval_env = PixelEnv(cfg.domain, cfg.task, seed + 12345, cfg.img, cfg.frame_stack, cfg.action_repeat)
    in_ch, act_dim = 3 * cfg.frame_stack, env.act_dim

    critic = Critic(in_ch, act_dim).to(device)
    critic_target = Critic(in_ch, act_dim).to(device)
    actor = Actor(in_ch, act_dim).to(device)
    critic = DDP(critic, device_ids=[rank])
    actor = DDP(actor, device_ids=[rank])
    critic_target.load_state_dict(critic.module.state_dict())
    actor.module.encoder.convs.load_state_dict(critic.module.encoder.convs.state_dict())  # share init
    log_alpha = torch.tensor(np.log(cfg.init_temp), device=device, requires_grad=True)
    target_entropy = -float(act_dim)

    critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.lr)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=cfg.lr)
    alpha_opt = torch.optim.Adam([log_alpha], lr=cfg.lr)
    replay = Replay(cfg.buffer_size // world_size, (in_ch, cfg.img, cfg.img), act_dim)
    writer = SummaryWriter(cfg.logdir) if rank == 0 else None

    total_steps = cfg.frames // cfg.action_repeat // world_size
    obs, ep_ret, ep_count = env.reset(), 0.0, 0
    t0 = time.time()
    for step in range(total_steps):
        if step < cfg.seed_steps:
            a = np.random.uniform(-1, 1, act_dim).astype(np.float32)
        else:
            with torch.no_grad():
                a, _, _ = actor.module(torch.as_tensor(obs[None], device=device, dtype=torch.float32))
            a = a[0].cpu().numpy()
        next_obs, r, done = env.step(a)
        replay.add(obs, a, r, next_obs, float(done))
        obs, ep_ret = next_obs, ep_ret + r
        if done:
            if rank == 0:
                writer.add_scalar("train/episode_return", ep_ret, step * world_size * cfg.action_repeat)
            obs, ep_ret, ep_count = env.reset(), 0.0, ep_count + 1

        if step >= cfg.seed_steps:
            o, act, rew, o2, nd = replay.sample(cfg.batch_size, device)
            o, o2 = random_shift(o), random_shift(o2)
            alpha = log_alpha.exp().detach()
            with torch.no_grad():
                a2, logp2, _ = actor.module(o2)
                tq1, tq2 = critic_target(o2, a2)
                target = rew + nd * cfg.gamma * (torch.min(tq1, tq2) - alpha * logp2)
            q1, q2 = critic(o, act)
            critic_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
            critic_opt.zero_grad(set_to_none=True)
            critic_loss.backward()
            critic_opt.step()

            pi, logp, _ = actor(o)
            aq1, aq2 = critic.module(o, pi, detach_encoder=True)
            actor_loss = (alpha * logp - torch.min(aq1, aq2)).mean()
            actor_opt.zero_grad(set_to_none=True)
            actor_loss.backward()
            actor_opt.step()

            alpha_loss = (log_alpha.exp() * (-logp.detach() - target_entropy)).mean()
            alpha_opt.zero_grad(set_to_none=True)
            alpha_loss.backward()
            dist.all_reduce(log_alpha.grad)
            log_alpha.grad /= world_size
            alpha_opt.step()

            with torch.no_grad():
                for p, tp in zip(critic.module.parameters(), critic_target.parameters()):
                    tp.lerp_(p, cfg.tau)

        if (step + 1) % (cfg.eval_every // cfg.action_repeat) == 0:
            rets = []
            for _ in range(cfg.eval_episodes):
                eo, done, R = eval_env.reset(), False, 0.0
                while not done:
                    with torch.no_grad():
                        _, _, mu = actor.module(torch.as_tensor(eo[None], device=device, dtype=torch.float32))
                    eo, r, done = eval_env.step(mu[0].cpu().numpy())
                    R += r
                rets.append(R)
            stat = torch.tensor([sum(rets), len(rets)], device=device, dtype=torch.float64)
            dist.all_reduce(stat)
            if rank == 0:
                frame = (step + 1) * world_size * cfg.action_repeat
                writer.add_scalar("eval/episode_return", (stat[0] / stat[1]).item(), frame)
                writer.add_scalar("train/alpha", log_alpha.exp().item(), frame)
                writer.add_scalar("perf/fps", frame / (time.time() - t0), frame)
                torch.save({"actor": actor.module.state_dict(), "critic": critic.module.state_dict(),
                            "critic_target": critic_target.state_dict(), "log_alpha": log_alpha.detach().cpu(),
                            "frame": frame}, os.path.join(cfg.logdir, "snapshot.pt"))

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = get_config()
    os.makedirs(cfg.logdir, exist_ok=True)
    mp.spawn(learner_main, args=(cfg, cfg.gpus), nprocs=cfg.gpus, join=True)
