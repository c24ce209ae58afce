"""
Continuous-action PPO (MuJoCo) with DDP and periodic deterministic evaluation.

The evaluation episodes are split over the ranks to keep evaluation cheap;
the best policy so far is kept in <out>/best.pt.

    torchrun --nproc_per_node=4 17_ppo_eval_best.py --config configs/hopper.yaml
"""
import argparse
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = dict(
    env_id="Hopper-v4", seed=0, num_envs=4, num_steps=512, total_timesteps=3_000_000,
    lr=3e-4, gamma=0.99, gae_lambda=0.95, update_epochs=10, num_minibatches=8,
    clip_coef=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5,
    eval_interval=20, eval_episodes=16, out="runs/ppo_mujoco",
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULTS)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg.update({k: v for k, v in vars(ns).items() if v is not None and k != "config"})
    return argparse.Namespace(**cfg)


def init_(m, gain=np.sqrt(2)):
    nn.init.orthogonal_(m.weight, gain)
    nn.init.zeros_(m.bias)
    return m


class GaussianAgent(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.critic = nn.Sequential(init_(nn.Linear(obs_dim, 64)), nn.Tanh(), init_(nn.Linear(64, 64)), nn.Tanh(),
                                    init_(nn.Linear(64, 1), 1.0))
        self.actor_mean = nn.Sequential(init_(nn.Linear(obs_dim, 64)), nn.Tanh(), init_(nn.Linear(64, 64)),
                                        nn.Tanh(), init_(nn.Linear(64, act_dim), 0.01))
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def forward(self, x, action=None):
        mean = self.actor_mean(x)
        std = self.actor_logstd.expand_as(mean).exp()
        pd = torch.distributions.Normal(mean, std)
        if action is None:
            action = pd.sample()
        return action, pd.log_prob(action).sum(1), pd.entropy().sum(1), self.critic(x).squeeze(-1)

    @torch.no_grad()
    def act_deterministic(self, x):
        return self.actor_mean(x)


def make_env(env_id, gamma):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        return env
    return thunk


def run_eval(agent, env_id, n_episodes, seed, device):
    env = gym.make(env_id)
    returns = []
    for i in range(n_episodes):
        obs, _ = env.reset(seed=seed + i)
        done, ret = False, 0.0
        while not done:
            a = agent.act_deterministic(torch.as_tensor(obs, dtype=torch.float32, device=device)[None])
            obs, r, term, trunc, _ = env.step(a[0].cpu().numpy())
            ret += r
            done = term or trunc
        returns.append(ret)
    env.close()
    return returns


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    writer = None
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        writer = SummaryWriter(cfg.out)
        with open(os.path.join(cfg.out, "config.yaml"), "w") as f:
            yaml.safe_dump(vars(cfg), f)

    envs = gym.vector.SyncVectorEnv([make_env(cfg.env_id, cfg.gamma) for _ in range(cfg.num_envs)])
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]
    agent = DDP(GaussianAgent(obs_dim, act_dim).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)

    T, N = cfg.num_steps, cfg.num_envs
    batch = T * N
    mb_size = batch // cfg.num_minibatches
    n_updates = cfg.total_timesteps // (batch * world)
    obs_b = torch.zeros((T, N, obs_dim), device=device)
    act_b = torch.zeros((T, N, act_dim), device=device)
    logp_b = torch.zeros((T, N), device=device)
    rew_b = torch.zeros((T, N), device=device)
    done_b = torch.zeros((T, N), device=device)
    val_b = torch.zeros((T, N), device=device)

    o, _ = envs.reset(seed=cfg.seed + 1000 * rank)
    next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
    next_done = torch.zeros(N, device=device)
    best_eval = -np.inf
    global_step, t0 = 0, time.time()

    for update in range(1, n_updates + 1):
        optim.param_groups[0]["lr"] = cfg.lr * (1.0 - (update - 1.0) / n_updates)
        for t in range(T):
            global_step += N * world
            obs_b[t], done_b[t] = next_obs, next_done
            with torch.no_grad():
                a, lp, _, v = agent.module(next_obs)
            act_b[t], logp_b[t], val_b[t] = a, lp, v
            o, r, term, trunc, _ = envs.step(a.cpu().numpy())
            rew_b[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
            next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)

        with torch.no_grad():
            next_v = agent.module.critic(next_obs).squeeze(-1)
            adv = torch.zeros_like(rew_b)
            last = 0
            for t in reversed(range(T)):
                nonterm = 1.0 - (next_done if t == T - 1 else done_b[t + 1])
                nv = next_v if t == T - 1 else val_b[t + 1]
                delta = rew_b[t] + cfg.gamma * nv * nonterm - val_b[t]
                adv[t] = last = delta + cfg.gamma * cfg.gae_lambda * nonterm * last
            ret = adv + val_b

        b_obs, b_act = obs_b.reshape(batch, obs_dim), act_b.reshape(batch, act_dim)
        b_logp, b_adv, b_ret = logp_b.reshape(-1), adv.reshape(-1), ret.reshape(-1)
        for _ in range(cfg.update_epochs):
            perm = torch.randperm(batch, device=device)
            for s in range(0, batch, mb_size):
                idx = perm[s:s + mb_size]
                _, lp, ent, v = agent(b_obs[idx], b_act[idx])
                ratio = (lp - b_logp[idx]).exp()
                mb_adv = (b_adv[idx] - b_adv[idx].mean()) / (b_adv[idx].std() + 1e-8)
                pg = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                vl = 0.5 * (v - b_ret[idx]).pow(2).mean()
                loss = pg - cfg.ent_coef * ent.mean() + cfg.vf_coef * vl
                optim.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                optim.step()

        if rank == 0:
            writer.add_scalar("loss/policy", pg.item(), global_step)
            writer.add_scalar("loss/value", vl.item(), global_step)
            writer.add_scalar("perf/sps", global_step / (time.time() - t0), global_step)

        if update % cfg.eval_interval == 0 or update == n_updates:
            per_rank = cfg.eval_episodes // world
            rets = run_eval(agent.module, cfg.env_id, per_rank, seed=10_000 + rank * per_rank, device=device)
            eval_mean = float(np.mean(rets))
            if rank == 0:
                writer.add_scalar("eval/return", eval_mean, global_step)
                print(f"update {update}/{n_updates} step {global_step} eval return {eval_mean:.1f}", flush=True)
                ckpt = {"agent": agent.module.state_dict(), "optim": optim.state_dict(),
                        "update": update, "global_step": global_step, "eval_return": eval_mean}
                torch.save(ckpt, os.path.join(cfg.out, "last.pt"))
                if eval_mean > best_eval:
                    best_eval = eval_mean
                    torch.save(ckpt, os.path.join(cfg.out, "best.pt"))
            dist.barrier()

    envs.close()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
