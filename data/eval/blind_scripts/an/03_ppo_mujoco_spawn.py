"""Multi-GPU PPO for MuJoCo locomotion. Each process owns a vector of CPU envs and
one GPU learner replica; gradients are averaged with DDP.

    python 03_ppo_mujoco_spawn.py --env_id Humanoid-v4 --world_size 4
"""
import argparse
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributions import Normal
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env_id", default="Humanoid-v4")
    p.add_argument("--world_size", type=int, default=torch.cuda.device_count())
    p.add_argument("--num_envs", type=int, default=16, help="envs per process")
    p.add_argument("--num_steps", type=int, default=256, help="rollout length per env")
    p.add_argument("--total_timesteps", type=int, default=50_000_000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae_lambda", type=float, default=0.95)
    p.add_argument("--update_epochs", type=int, default=10)
    p.add_argument("--num_minibatches", type=int, default=8)
    p.add_argument("--clip_coef", type=float, default=0.2)
    p.add_argument("--ent_coef", type=float, default=0.0)
    p.add_argument("--vf_coef", type=float, default=0.5)
    p.add_argument("--max_grad_norm", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=str, default="29512")
    p.add_argument("--run_dir", default="runs/ppo")
    p.add_argument("--save_every", type=int, default=100)
    return p.parse_args()


def make_env(env_id, seed):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.ClipAction(env)
        env.action_space.seed(seed)
        return env
    return thunk


class RunningMeanStd:
    def __init__(self, shape, device):
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.ones(shape, device=device)
        self.count = torch.tensor(1e-4, device=device)

    def update_from_moments(self, b_mean, b_var, b_count):
        delta = b_mean - self.mean
        tot = self.count + b_count
        self.mean = self.mean + delta * b_count / tot
        m2 = self.var * self.count + b_var * b_count + delta.pow(2) * self.count * b_count / tot
        self.var = m2 / tot
        self.count = tot

    def normalize(self, x):
        return torch.clamp((x - self.mean) / torch.sqrt(self.var + 1e-8), -10.0, 10.0)


def sync_obs_stats(rms, obs_batch, world_size):
    # moments over every rank's rollout, so all replicas normalise identically
    n = torch.tensor(float(obs_batch.shape[0]), device=obs_batch.device)
    s = obs_batch.sum(0)
    sq = obs_batch.pow(2).sum(0)
    packed = torch.cat([s, sq, n.view(1)])
    dist.all_reduce(packed)
    d = obs_batch.shape[1]
    total = packed[-1]
    mean = packed[:d] / total
    var = packed[d:2 * d] / total - mean.pow(2)
    rms.update_from_moments(mean, var.clamp_min(0.0), total)


def layer_init(layer, std=np.sqrt(2), bias=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, act_dim):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, 256)), nn.Tanh(),
                                    layer_init(nn.Linear(256, 256)), nn.Tanh(),
                                    layer_init(nn.Linear(256, 1), std=1.0))
        self.actor_mean = nn.Sequential(layer_init(nn.Linear(obs_dim, 256)), nn.Tanh(),
                                        layer_init(nn.Linear(256, 256)), nn.Tanh(),
                                        layer_init(nn.Linear(256, act_dim), std=0.01))
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def forward(self, obs, action=None):
        mean = self.actor_mean(obs)
        dist_ = Normal(mean, self.actor_logstd.expand_as(mean).exp())
        if action is None:
            action = dist_.sample()
        return action, dist_.log_prob(action).sum(-1), dist_.entropy().sum(-1), self.critic(obs).squeeze(-1)


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    seed = args.seed + 10_000 * rank
    np.random.seed(seed)
    torch.manual_seed(seed)  # per-rank exploration noise; DDP broadcasts rank 0's initial weights

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, seed + i) for i in range(args.num_envs)])
    obs_dim = envs.single_observation_space.shape[0]
    act_dim = envs.single_action_space.shape[0]

    model = DDP(ActorCritic(obs_dim, act_dim).to(device), device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    obs_rms = RunningMeanStd(obs_dim, device)
    writer = SummaryWriter(args.run_dir) if rank == 0 else None

    T, N = args.num_steps, args.num_envs
    batch_size = T * N
    minibatch_size = batch_size // args.num_minibatches
    num_updates = args.total_timesteps // (batch_size * world_size)

    obs_buf = torch.zeros(T, N, obs_dim, device=device)
    raw_obs_buf = torch.zeros(T, N, obs_dim, device=device)
    act_buf = torch.zeros(T, N, act_dim, device=device)
    logp_buf = torch.zeros(T, N, device=device)
    rew_buf = torch.zeros(T, N, device=device)
    done_buf = torch.zeros(T, N, device=device)
    val_buf = torch.zeros(T, N, device=device)

    next_obs, _ = envs.reset(seed=seed)
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    next_done = torch.zeros(N, device=device)
    global_step = 0
    t_start = time.time()

    for update in range(1, num_updates + 1):
        frac = 1.0 - (update - 1.0) / num_updates
        optimizer.param_groups[0]["lr"] = frac * args.lr
        ep_returns, ep_lengths = [], []

        model.eval()
        for t in range(T):
            raw_obs_buf[t] = next_obs
            obs_n = obs_rms.normalize(next_obs)
            obs_buf[t] = obs_n
            done_buf[t] = next_done
            with torch.no_grad():
                action, logp, _, value = model.module(obs_n)
            act_buf[t], logp_buf[t], val_buf[t] = action, logp, value
            o, r, term, trunc, info = envs.step(action.cpu().numpy())
            rew_buf[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
            next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
            if "episode" in info:
                mask = info["_episode"]
                ep_returns.extend(info["episode"]["r"][mask].tolist())
                ep_lengths.extend(info["episode"]["l"][mask].tolist())
        global_step += batch_size * world_size

        with torch.no_grad():
            _, _, _, next_value = model.module(obs_rms.normalize(next_obs))
            adv = torch.zeros_like(rew_buf)
            lastgaelam = 0
            for t in reversed(range(T)):
                nonterminal = 1.0 - (next_done if t == T - 1 else done_buf[t + 1])
                nv = next_value if t == T - 1 else val_buf[t + 1]
                delta = rew_buf[t] + args.gamma * nv * nonterminal - val_buf[t]
                adv[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nonterminal * lastgaelam
            ret = adv + val_buf

        sync_obs_stats(obs_rms, raw_obs_buf.reshape(-1, obs_dim), world_size)

        b_obs = obs_buf.reshape(-1, obs_dim)
        b_act = act_buf.reshape(-1, act_dim)
        b_logp, b_adv, b_ret, b_val = logp_buf.reshape(-1), adv.reshape(-1), ret.reshape(-1), val_buf.reshape(-1)

        model.train()
        for _ in range(args.update_epochs):
            perm = torch.randperm(batch_size, device=device)
            for start in range(0, batch_size, minibatch_size):
                mb = perm[start:start + minibatch_size]
                _, new_logp, ent, new_v = model(b_obs[mb], b_act[mb])
                ratio = (new_logp - b_logp[mb]).exp()
                mb_adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
                v_clipped = b_val[mb] + (new_v - b_val[mb]).clamp(-args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((new_v - b_ret[mb]).pow(2), (v_clipped - b_ret[mb]).pow(2)).mean()
                loss = pg_loss - args.ent_coef * ent.mean() + args.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()

        stats = torch.tensor([sum(ep_returns), sum(ep_lengths), len(ep_returns),
                              pg_loss.item(), v_loss.item()], device=device, dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            n_eps = max(stats[2].item(), 1.0)
            writer.add_scalar("charts/episodic_return", stats[0].item() / n_eps, global_step)
            writer.add_scalar("charts/episodic_length", stats[1].item() / n_eps, global_step)
            writer.add_scalar("losses/policy_loss", stats[3].item() / world_size, global_step)
            writer.add_scalar("losses/value_loss", stats[4].item() / world_size, global_step)
            writer.add_scalar("charts/SPS", global_step / (time.time() - t_start), global_step)
            if update % args.save_every == 0 or update == num_updates:
                torch.save({"model": model.module.state_dict(),
                            "obs_rms": {"mean": obs_rms.mean.cpu(), "var": obs_rms.var.cpu(),
                                        "count": obs_rms.count.cpu()},
                            "update": update, "global_step": global_step},
                           os.path.join(args.run_dir, f"ppo_{update:06d}.pt"))

    envs.close()
    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.run_dir, exist_ok=True)
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size, join=True)
