"""PPO for continuous-control manipulation tasks (Pusher / Reacher family).

Hyper-parameters come from a YAML file; CLI flags override single keys:
    torchrun --nproc_per_node=4 ppo_continuous.py --config configs/pusher.yaml --set lr=1e-4
"""
import argparse
import logging
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    env_id="Pusher-v4", num_envs=16, rollout_len=256, total_steps=20_000_000, lr=3e-4,
    gamma=0.99, lam=0.95, clip=0.2, epochs=10, minibatch=1024, vf_coef=0.5, ent_coef=0.0,
    max_grad_norm=0.5, init_log_std=-0.5, seed=0, log_every=5, save_every=100,
    out_dir="outputs/pusher_ppo",
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides")
    ns = ap.parse_args()
    cfg = dict(DEFAULTS)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in ns.set:
        k, v = kv.split("=", 1)
        cfg[k] = type(DEFAULTS[k])(v) if k in DEFAULTS else yaml.safe_load(v)
    return argparse.Namespace(**cfg)


def mlp(inp, out, hidden=(256, 256), out_gain=1.0):
    layers, d = [], inp
    for h in hidden:
        lin = nn.Linear(d, h)
        nn.init.orthogonal_(lin.weight, np.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Tanh()]
        d = h
    last = nn.Linear(d, out)
    nn.init.orthogonal_(last.weight, out_gain)
    nn.init.zeros_(last.bias)
    return nn.Sequential(*layers, last)


class GaussianActorCritic(nn.Module):
    def __init__(self, obs_dim, act_dim, init_log_std):
        super().__init__()
        self.pi = mlp(obs_dim, act_dim, out_gain=0.01)
        self.vf = mlp(obs_dim, 1, out_gain=1.0)
        self.actor_logstd = nn.Parameter(torch.full((act_dim,), float(init_log_std)))

    def distribution(self, obs):
        return Normal(self.pi(obs), self.actor_logstd.exp())

    @torch.no_grad()
    def act(self, obs):
        d = self.distribution(obs)
        a = d.sample()
        return a, d.log_prob(a).sum(-1), self.vf(obs).squeeze(-1)

    def forward(self, obs, actions):
        d = self.distribution(obs)
        return d.log_prob(actions).sum(-1), d.entropy().sum(-1), self.vf(obs).squeeze(-1)


class RunningMeanStd:
    """Observation normaliser; statistics are kept in sync across ranks."""

    def __init__(self, shape, device):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(1e-4, device=device)

    def update(self, x):
        n = torch.tensor(float(x.shape[0]), device=x.device)
        s = torch.cat([x.sum(0), (x * x).sum(0), n[None]])
        dist.all_reduce(s)
        d = x.shape[1]
        tot = s[-1]
        b_mean = s[:d] / tot
        b_var = s[d:2 * d] / tot - b_mean ** 2
        delta = b_mean - self.mean
        new_count = self.count + tot
        self.mean = self.mean + delta * tot / new_count
        m2 = self.var * self.count + b_var * tot + delta ** 2 * self.count * tot / new_count
        self.var = m2 / new_count
        self.count = new_count

    def __call__(self, x):
        return torch.clamp((x - self.mean) / torch.sqrt(self.var + 1e-8), -10, 10)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    log = logging.getLogger(__name__)

    envs = gym.vector.AsyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(cfg.env_id))
                                      for _ in range(cfg.num_envs)])
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]
    low = torch.as_tensor(envs.single_action_space.low, device=device)
    high = torch.as_tensor(envs.single_action_space.high, device=device)

    torch.manual_seed(cfg.seed)
    agent = DDP(GaussianActorCritic(obs_dim, act_dim, cfg.init_log_std).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
    obs_rms = RunningMeanStd(obs_dim, device)
    torch.manual_seed(cfg.seed + 1 + rank)

    writer = SummaryWriter(cfg.out_dir) if rank == 0 else None
    T, N = cfg.rollout_len, cfg.num_envs
    n_iters = cfg.total_steps // (T * N * world)

    raw_obs, _ = envs.reset(seed=cfg.seed * 997 + rank * N)
    ep_returns = []
    t0 = time.time()
    for it in range(1, n_iters + 1):
        buf_raw = torch.zeros(T, N, obs_dim, device=device)
        buf_act = torch.zeros(T, N, act_dim, device=device)
        buf_logp = torch.zeros(T, N, device=device)
        buf_val = torch.zeros(T, N, device=device)
        buf_rew = torch.zeros(T, N, device=device)
        buf_done = torch.zeros(T, N, device=device)

        for t in range(T):
            o = torch.as_tensor(raw_obs, dtype=torch.float32, device=device)
            buf_raw[t] = o
            a, logp, v = agent.module.act(obs_rms(o))
            raw_obs, r, term, trunc, info = envs.step(torch.clamp(a, low, high).cpu().numpy())
            buf_act[t], buf_logp[t], buf_val[t] = a, logp, v
            buf_rew[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            buf_done[t] = torch.as_tensor(term | trunc, dtype=torch.float32, device=device)
            if "final_info" in info:
                ep_returns += [float(fi["episode"]["r"]) for fi in info["final_info"] if fi and "episode" in fi]

        with torch.no_grad():
            _, _, last_v = agent.module.act(obs_rms(torch.as_tensor(raw_obs, dtype=torch.float32, device=device)))
            adv = torch.zeros(T, N, device=device)
            gae = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nv = last_v if t == T - 1 else buf_val[t + 1]
                nonterm = 1.0 - buf_done[t]
                delta = buf_rew[t] + cfg.gamma * nv * nonterm - buf_val[t]
                gae = delta + cfg.gamma * cfg.lam * nonterm * gae
                adv[t] = gae
            ret = adv + buf_val

        b_obs = obs_rms(buf_raw.reshape(T * N, obs_dim))
        obs_rms.update(buf_raw.reshape(T * N, obs_dim))
        b_act, b_logp = buf_act.reshape(T * N, act_dim), buf_logp.reshape(-1)
        b_adv, b_ret = adv.reshape(-1), ret.reshape(-1)

        frac = 1.0 - (it - 1) / n_iters
        for g in optim.param_groups:
            g["lr"] = cfg.lr * frac

        for _ in range(cfg.epochs):
            perm = torch.randperm(T * N, device=device)
            for s in range(0, T * N, cfg.minibatch):
                idx = perm[s:s + cfg.minibatch]
                new_logp, ent, v = agent(b_obs[idx], b_act[idx])
                ratio = torch.exp(new_logp - b_logp[idx])
                mb_adv = (b_adv[idx] - b_adv[idx].mean()) / (b_adv[idx].std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)).mean()
                v_loss = 0.5 * (v - b_ret[idx]).pow(2).mean()
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * ent.mean()
                optim.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                optim.step()

        if it % cfg.log_every == 0:
            s = torch.tensor([sum(ep_returns), len(ep_returns)], dtype=torch.float32, device=device)
            dist.all_reduce(s)
            ep_returns.clear()
            if rank == 0:
                step = it * T * N * world
                writer.add_scalar("loss/policy", pg_loss.item(), step)
                writer.add_scalar("loss/value", v_loss.item(), step)
                writer.add_scalar("policy/action_std", agent.actor_logstd.exp().mean().item(), step)
                writer.add_scalar("perf/sps", step / (time.time() - t0), step)
                if s[1] > 0:
                    writer.add_scalar("train/episode_return", (s[0] / s[1]).item(), step)
                log.info("iter %d/%d step %d return %.1f", it, n_iters, step,
                         (s[0] / s[1]).item() if s[1] > 0 else float("nan"))

        if rank == 0 and (it % cfg.save_every == 0 or it == n_iters):
            os.makedirs(cfg.out_dir, exist_ok=True)
            torch.save({"agent": agent.module.state_dict(), "obs_mean": obs_rms.mean.cpu(),
                        "obs_var": obs_rms.var.cpu(), "iter": it}, os.path.join(cfg.out_dir, "agent.pt"))

    envs.close()
    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
