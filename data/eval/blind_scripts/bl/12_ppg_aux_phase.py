"""
Phasic Policy Gradient (Cobbe et al. 2020), data parallel with DDP.

Policy phase: N_pi PPO iterations (clipped surrogate + value loss on a separate
value network). Auxiliary phase: distil the value into an auxiliary head on the
policy network while a KL term keeps the policy in place.

    torchrun --nproc_per_node=4 12_ppg_aux_phase.py --env-id LunarLander-v2
"""
import argparse
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence
from torch.nn.parallel import DistributedDataParallel as DDP


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="LunarLander-v2")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--num-steps", type=int, default=256)
    p.add_argument("--total-timesteps", type=int, default=20_000_000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--aux-lr", type=float, default=5e-4)
    p.add_argument("--gamma", type=float, default=0.999)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--n-iteration", type=int, default=32, help="policy iterations per phase")
    p.add_argument("--e-policy", type=int, default=1)
    p.add_argument("--e-aux", type=int, default=6)
    p.add_argument("--beta-clone", type=float, default=1.0)
    p.add_argument("--num-minibatches", type=int, default=8)
    p.add_argument("--num-aux-minibatches", type=int, default=16)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--out", default="checkpoints/ppg")
    return p.parse_args()


def layer_init(layer, std=np.sqrt(2), bias=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class PPGAgent(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.policy_trunk = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
                                          layer_init(nn.Linear(hidden, hidden)), nn.Tanh())
        self.policy_head = layer_init(nn.Linear(hidden, n_actions), std=0.01)
        self.aux_critic = layer_init(nn.Linear(hidden, 1), std=1.0)
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, hidden)), nn.Tanh(),
                                    layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
                                    layer_init(nn.Linear(hidden, 1), std=1.0))

    def forward(self, x, action=None):
        h = self.policy_trunk(x)
        logits = self.policy_head(h)
        pd = Categorical(logits=logits)
        if action is None:
            action = pd.sample()
        return action, pd.log_prob(action), pd.entropy(), self.critic(x).squeeze(-1), \
            self.aux_critic(h).squeeze(-1), logits


def compute_gae(rewards, values, dones, next_value, next_done, gamma, lam):
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = 0
    for t in reversed(range(T)):
        nonterm = 1.0 - (next_done if t == T - 1 else dones[t + 1])
        nv = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * nv * nonterm - values[t]
        adv[t] = last = delta + gamma * lam * nonterm * last
    return adv, adv + values


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(cfg.env_id)) for _ in range(cfg.num_envs)])
    obs_dim = envs.single_observation_space.shape[0]
    n_act = envs.single_action_space.n

    agent = DDP(PPGAgent(obs_dim, n_act).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr, eps=1e-5)
    aux_opt = torch.optim.Adam(agent.parameters(), lr=cfg.aux_lr, eps=1e-5)

    T, N = cfg.num_steps, cfg.num_envs
    batch = T * N
    mb = batch // cfg.num_minibatches
    num_phases = cfg.total_timesteps // (batch * world * cfg.n_iteration)

    obs_buf = torch.zeros((T, N, obs_dim), device=device)
    act_buf = torch.zeros((T, N), dtype=torch.long, device=device)
    logp_buf = torch.zeros((T, N), device=device)
    rew_buf = torch.zeros((T, N), device=device)
    done_buf = torch.zeros((T, N), device=device)
    val_buf = torch.zeros((T, N), device=device)
    aux_obs = torch.zeros((cfg.n_iteration, T * N, obs_dim), device=device)
    aux_ret = torch.zeros((cfg.n_iteration, T * N), device=device)

    o, _ = envs.reset(seed=cfg.seed + 997 * rank)
    next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
    next_done = torch.zeros(N, device=device)
    global_step, tic = 0, time.time()

    for phase in range(1, num_phases + 1):
        ep_rets = []
        for it in range(cfg.n_iteration):
            for t in range(T):
                obs_buf[t], done_buf[t] = next_obs, next_done
                with torch.no_grad():
                    a, logp, _, v, _, _ = agent.module(next_obs)
                act_buf[t], logp_buf[t], val_buf[t] = a, logp, v
                o, r, term, trunc, info = envs.step(a.cpu().numpy())
                rew_buf[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
                next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
                next_done = torch.as_tensor(term | trunc, dtype=torch.float32, device=device)
                if "final_info" in info:
                    ep_rets += [fi["episode"]["r"] for fi in info["final_info"] if fi and "episode" in fi]
            global_step += batch * world

            with torch.no_grad():
                next_v = agent.module.critic(next_obs).squeeze(-1)
                adv, ret = compute_gae(rew_buf, val_buf, done_buf, next_v, next_done, cfg.gamma, cfg.gae_lambda)

            b_obs, b_act, b_logp = obs_buf.reshape(batch, -1), act_buf.reshape(-1), logp_buf.reshape(-1)
            b_adv, b_ret = adv.reshape(-1), ret.reshape(-1)
            for _ in range(cfg.e_policy):
                perm = torch.randperm(batch, device=device)
                for s in range(0, batch, mb):
                    idx = perm[s:s + mb]
                    _, new_logp, ent, new_v, _, _ = agent(b_obs[idx], b_act[idx])
                    ratio = (new_logp - b_logp[idx]).exp()
                    a_n = (b_adv[idx] - b_adv[idx].mean()) / (b_adv[idx].std() + 1e-8)
                    pg_loss = torch.max(-a_n * ratio, -a_n * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
                    v_loss = 0.5 * (new_v - b_ret[idx]).pow(2).mean()
                    loss = pg_loss - cfg.ent_coef * ent.mean() + v_loss
                    opt.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                    opt.step()

            aux_obs[it] = b_obs
            aux_ret[it] = b_ret

        # ---- auxiliary phase ----
        flat_obs = aux_obs.reshape(-1, obs_dim)
        flat_ret = aux_ret.reshape(-1)
        with torch.no_grad():
            old_logits = torch.cat([agent.module.policy_head(agent.module.policy_trunk(c))
                                    for c in flat_obs.split(8192)])
        n_aux = flat_obs.shape[0]
        aux_mb = n_aux // cfg.num_aux_minibatches
        for _ in range(cfg.e_aux):
            perm = torch.randperm(n_aux, device=device)
            for s in range(0, n_aux, aux_mb):
                idx = perm[s:s + aux_mb]
                _, _, _, v, aux_v, logits = agent(flat_obs[idx])
                kl = kl_divergence(Categorical(logits=old_logits[idx]), Categorical(logits=logits)).mean()
                aux_loss = 0.5 * (aux_v - flat_ret[idx]).pow(2).mean()
                real_v_loss = 0.5 * (v - flat_ret[idx]).pow(2).mean()
                loss = aux_loss + cfg.beta_clone * kl + real_v_loss
                aux_opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
                aux_opt.step()

        stats = torch.tensor([float(np.sum(ep_rets)), float(len(ep_rets)), kl.item(), aux_loss.item()],
                             device=device)
        dist.all_reduce(stats)
        if rank == 0:
            mean_ret = (stats[0] / stats[1]).item() if stats[1] > 0 else float("nan")
            print(f"phase {phase}/{num_phases} step {global_step} return {mean_ret:.1f} "
                  f"kl {stats[2].item() / world:.4f} aux {stats[3].item() / world:.3f} "
                  f"sps {global_step / (time.time() - tic):.0f}", flush=True)
            os.makedirs(cfg.out, exist_ok=True)
            torch.save({"agent": agent.module.state_dict(), "opt": opt.state_dict(),
                        "aux_opt": aux_opt.state_dict(), "phase": phase, "global_step": global_step},
                       os.path.join(cfg.out, "ppg_latest.pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
