"""Recurrent PPO (LSTM core) for memory tasks, multi-GPU.

- LSTM state is carried across rollouts and reset on episode boundaries.
- Minibatches are built from whole environment sequences (no shuffling in time).
- Advantages are normalised with statistics of the GLOBAL batch (all ranks).
- Evaluation episodes are split over ranks and the sums are all-reduced.

    torchrun --nproc_per_node=4 recurrent_ppo_lstm.py --env-id MiniGrid-MemoryS11-v0
    torchrun --nproc_per_node=4 recurrent_ppo_lstm.py --resume runs/rppo/checkpoint.pt
"""
import argparse
import os
import time

import gymnasium as gym
import minigrid  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from minigrid.wrappers import ImgObsWrapper
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="MiniGrid-MemoryS11-v0")
    p.add_argument("--num-envs", type=int, default=32, help="per rank")
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--total-timesteps", type=int, default=100_000_000)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-episodes", type=int, default=128)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--run-dir", default="runs/rppo")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def make_env(env_id, seed):
    def thunk():
        env = ImgObsWrapper(gym.make(env_id))
        env = gym.wrappers.FlattenObservation(env)
        env.reset(seed=seed)
        return env
    return thunk


class LSTMAgent(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=256):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, hidden), nn.ReLU())
        self.lstm = nn.LSTM(hidden, hidden)
        self.actor = nn.Linear(hidden, n_actions)
        self.critic = nn.Linear(hidden, 1)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.constant_(param, 0)
            elif "weight" in name:
                nn.init.orthogonal_(param, 1.0)

    def core(self, obs, lstm_state, done):
        # obs: [T * B, obs_dim], done: [T * B]; lstm_state: ([1, B, H], [1, B, H])
        h = self.encoder(obs.float() / 10.0)
        B = lstm_state[0].shape[1]
        h = h.reshape(-1, B, h.shape[-1])
        done = done.reshape(-1, B)
        outs = []
        for x, d in zip(h, done):
            mask = (1.0 - d).view(1, -1, 1)
            out, lstm_state = self.lstm(x.unsqueeze(0), (mask * lstm_state[0], mask * lstm_state[1]))
            outs.append(out)
        return torch.flatten(torch.cat(outs), 0, 1), lstm_state

    def forward(self, obs, lstm_state, done, action=None):
        h, lstm_state = self.core(obs, lstm_state, done)
        dist_ = Categorical(logits=self.actor(h))
        if action is None:
            action = dist_.sample()
        return action, dist_.log_prob(action), dist_.entropy(), self.critic(h).squeeze(-1), lstm_state


@torch.no_grad()
def evaluate(agent, env_id, n_episodes, seed, device):
    env = make_env(env_id, seed)()
    total, count = 0.0, 0
    for ep in range(n_episodes):
        obs, _ = env.reset(seed=seed + ep)
        state = (torch.zeros(1, 1, agent.lstm.hidden_size, device=device),) * 2
        done, ret = False, 0.0
        while not done:
            o = torch.as_tensor(obs, device=device).unsqueeze(0)
            h, state = agent.core(o, state, torch.zeros(1, device=device))
            action = agent.actor(h).argmax(-1)
            obs, r, term, trunc, _ = env.step(int(action.item()))
            ret += r
            done = term or trunc
        total += ret
        count += 1
    env.close()
    return total, count


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    envs = gym.vector.SyncVectorEnv(
        [make_env(args.env_id, args.seed * 10_007 + rank * args.num_envs + i) for i in range(args.num_envs)]
    )
    obs_dim = envs.single_observation_space.shape[0]
    n_actions = envs.single_action_space.n

    torch.manual_seed(args.seed)
    agent = LSTMAgent(obs_dim, n_actions).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    start_update = 1
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        agent.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_update = ckpt["update"] + 1
    model = DDP(agent, device_ids=[local_rank])
    torch.manual_seed(args.seed + 1 + rank)

    T, N, H = args.num_steps, args.num_envs, agent.lstm.hidden_size
    num_updates = args.total_timesteps // (T * N * world)
    envs_per_mb = N // args.num_minibatches
    eval_per_rank = args.eval_episodes // world

    obs = torch.zeros(T, N, obs_dim, device=device)
    actions = torch.zeros(T, N, dtype=torch.long, device=device)
    logprobs = torch.zeros(T, N, device=device)
    rewards = torch.zeros(T, N, device=device)
    dones = torch.zeros(T, N, device=device)
    values = torch.zeros(T, N, device=device)

    next_obs = torch.as_tensor(envs.reset()[0], dtype=torch.float32, device=device)
    next_done = torch.zeros(N, device=device)
    next_state = (torch.zeros(1, N, H, device=device), torch.zeros(1, N, H, device=device))
    ep_sum = torch.zeros(2, device=device)
    running_ret = np.zeros(N)
    t0 = time.time()

    for update in range(start_update, num_updates + 1):
        init_state = (next_state[0].clone(), next_state[1].clone())
        optimizer.param_groups[0]["lr"] = args.lr * (1.0 - (update - 1.0) / num_updates)
        for t in range(T):
            obs[t], dones[t] = next_obs, next_done
            with torch.no_grad():
                a, lp, _, v, next_state = agent(next_obs, next_state, next_done)
            actions[t], logprobs[t], values[t] = a, lp, v
            o, r, term, trunc, _ = envs.step(a.cpu().numpy())
            done = np.logical_or(term, trunc)
            running_ret += r
            for i in np.flatnonzero(done):
                ep_sum += torch.tensor([running_ret[i], 1.0], device=device)
                running_ret[i] = 0.0
            rewards[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
            next_done = torch.as_tensor(done, dtype=torch.float32, device=device)

        with torch.no_grad():
            _, _, _, next_value, _ = agent(next_obs, next_state, next_done)
            adv = torch.zeros_like(rewards)
            last = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nnt = 1.0 - (next_done if t == T - 1 else dones[t + 1])
                nv = next_value if t == T - 1 else values[t + 1]
                last = rewards[t] + args.gamma * nv * nnt - values[t] + args.gamma * args.gae_lambda * nnt * last
                adv[t] = last
            returns = adv + values
            # normalise with the statistics of the whole (all-rank) batch
            s = torch.stack([adv.sum(), (adv ** 2).sum(), torch.tensor(float(adv.numel()), device=device)])
            dist.all_reduce(s)
            mean = s[0] / s[2]
            std = torch.sqrt(s[1] / s[2] - mean ** 2 + 1e-8)
            norm_adv = (adv - mean) / std

        env_ids = np.arange(N)
        for _ in range(args.update_epochs):
            np.random.shuffle(env_ids)
            for start in range(0, N, envs_per_mb):
                mb_envs = torch.as_tensor(env_ids[start:start + envs_per_mb], device=device)
                mb_state = (init_state[0][:, mb_envs], init_state[1][:, mb_envs])
                _, newlogprob, entropy, newvalue, _ = model(
                    obs[:, mb_envs].reshape(-1, obs_dim), mb_state, dones[:, mb_envs].reshape(-1),
                    actions[:, mb_envs].reshape(-1),
                )
                ratio = (newlogprob - logprobs[:, mb_envs].reshape(-1)).exp()
                mb_adv = norm_adv[:, mb_envs].reshape(-1)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
                v_loss = 0.5 * (newvalue - returns[:, mb_envs].reshape(-1)).pow(2).mean()
                loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy.mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()

        if update % 10 == 0:
            dist.all_reduce(ep_sum)
            if rank == 0 and ep_sum[1] > 0:
                sps = (update - start_update + 1) * T * N * world / (time.time() - t0)
                print(f"update {update} return {(ep_sum[0] / ep_sum[1]).item():.3f} "
                      f"pg {pg_loss.item():.4f} v {v_loss.item():.4f} sps {sps:.0f}", flush=True)
            ep_sum.zero_()

        if update % args.eval_every == 0 or update == num_updates:
            tot, cnt = evaluate(agent, args.env_id, eval_per_rank, 1_000_000 + rank * eval_per_rank, device)
            ev = torch.tensor([tot, float(cnt)], device=device)
            dist.all_reduce(ev)
            if rank == 0:
                print(f"[eval] update {update} mean return {(ev[0] / ev[1]).item():.3f} over {int(ev[1].item())} eps",
                      flush=True)
                os.makedirs(args.run_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "update": update},
                           os.path.join(args.run_dir, "checkpoint.pt"))
            dist.barrier()

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
