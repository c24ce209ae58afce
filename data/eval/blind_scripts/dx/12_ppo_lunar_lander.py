"""PPO on LunarLander-v2 (discrete) with periodic greedy evaluation.

Evaluation episodes are split over the ranks so evaluation costs the same wall
time regardless of the GPU count; the best checkpoint is chosen on eval return.

    torchrun --nproc_per_node=4 ppo_lunar_lander.py --total-steps 10000000 --eval-episodes 64
"""
import argparse
import os
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="LunarLander-v2")
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--num-steps", type=int, default=256)
    p.add_argument("--total-steps", type=int, default=10_000_000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.999)
    p.add_argument("--gae-lambda", type=float, default=0.98)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--eval-interval", type=int, default=25, help="updates between evaluations")
    p.add_argument("--eval-episodes", type=int, default=64, help="total over all ranks")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--run-dir", default="runs/lunar_ppo")
    return p.parse_args()


class ActorCritic(nn.Module):
    def __init__(self, obs_dim, n_actions, hidden=128):
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.logits = nn.Linear(hidden, n_actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, obs):
        h = self.shared(obs)
        return self.logits(h), self.value(h).squeeze(-1)


@torch.no_grad()
def run_eval(policy, env_id, episodes, seed, device):
    env = gym.make(env_id)
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done, ep_ret = False, 0.0
        while not done:
            logits, _ = policy(torch.as_tensor(obs, dtype=torch.float32, device=device).unsqueeze(0))
            obs, r, term, trunc, _ = env.step(int(logits.argmax(-1).item()))
            ep_ret += r
            done = term or trunc
        returns.append(ep_ret)
    env.close()
    return returns


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    rank_seed = args.seed + 1000 * rank
    np.random.seed(rank_seed)
    envs = gym.vector.SyncVectorEnv(
        [lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id)) for _ in range(args.num_envs)]
    )
    obs_dim = envs.single_observation_space.shape[0]
    n_actions = envs.single_action_space.n

    torch.manual_seed(args.seed)
    net = ActorCritic(obs_dim, n_actions).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    torch.manual_seed(rank_seed)

    writer = None
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        writer = SummaryWriter(args.run_dir)

    S, E = args.num_steps, args.num_envs
    batch = S * E
    mb = batch // args.num_minibatches
    num_updates = args.total_steps // (batch * world)
    eval_per_rank = args.eval_episodes // world

    obs_buf = torch.zeros(S, E, obs_dim, device=device)
    act_buf = torch.zeros(S, E, dtype=torch.long, device=device)
    logp_buf = torch.zeros(S, E, device=device)
    rew_buf = torch.zeros(S, E, device=device)
    done_buf = torch.zeros(S, E, device=device)
    val_buf = torch.zeros(S, E, device=device)

    next_obs, _ = envs.reset(seed=rank_seed)
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    next_done = torch.zeros(E, device=device)
    best_eval = -float("inf")
    start = time.time()

    for update in range(1, num_updates + 1):
        for g in optimizer.param_groups:
            g["lr"] = args.lr * (1.0 - (update - 1) / num_updates)

        ep_stats = torch.zeros(2, device=device)
        for t in range(S):
            obs_buf[t], done_buf[t] = next_obs, next_done
            with torch.no_grad():
                logits, value = net(next_obs)
                d = Categorical(logits=logits)
                action = d.sample()
            act_buf[t], logp_buf[t], val_buf[t] = action, d.log_prob(action), value
            o, r, term, trunc, info = envs.step(action.cpu().numpy())
            rew_buf[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
            next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
            if "final_info" in info:
                for fi in info["final_info"]:
                    if fi is not None and "episode" in fi:
                        ep_stats += torch.tensor([float(fi["episode"]["r"]), 1.0], device=device)

        with torch.no_grad():
            _, next_value = net(next_obs)
            adv = torch.zeros_like(rew_buf)
            last = torch.zeros(E, device=device)
            for t in reversed(range(S)):
                nnt = 1.0 - (next_done if t == S - 1 else done_buf[t + 1])
                nv = next_value if t == S - 1 else val_buf[t + 1]
                delta = rew_buf[t] + args.gamma * nv * nnt - val_buf[t]
                last = delta + args.gamma * args.gae_lambda * nnt * last
                adv[t] = last
            ret = adv + val_buf

        b_obs, b_act, b_logp = obs_buf.view(batch, obs_dim), act_buf.view(-1), logp_buf.view(-1)
        b_adv, b_ret = adv.view(-1), ret.view(-1)
        for _ in range(args.update_epochs):
            perm = torch.randperm(batch, device=device)
            for s in range(0, batch, mb):
                idx = perm[s:s + mb]
                logits, v = model(b_obs[idx])
                d = Categorical(logits=logits)
                ratio = (d.log_prob(b_act[idx]) - b_logp[idx]).exp()
                a = (b_adv[idx] - b_adv[idx].mean()) / (b_adv[idx].std() + 1e-8)
                pg_loss = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
                v_loss = 0.5 * (v - b_ret[idx]).pow(2).mean()
                ent = d.entropy().mean()
                loss = pg_loss + args.vf_coef * v_loss - args.ent_coef * ent
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()

        dist.all_reduce(ep_stats)
        global_step = update * batch * world
        if rank == 0:
            writer.add_scalar("train/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("train/value_loss", v_loss.item(), global_step)
            writer.add_scalar("train/entropy", ent.item(), global_step)
            writer.add_scalar("train/sps", global_step / (time.time() - start), global_step)
            if ep_stats[1] > 0:
                writer.add_scalar("train/episode_return", (ep_stats[0] / ep_stats[1]).item(), global_step)

        if update % args.eval_interval == 0 or update == num_updates:
            eval_returns = run_eval(net, args.env_id, eval_per_rank,
                                    seed=10_000_000 + update * args.eval_episodes + rank * eval_per_rank,
                                    device=device)
            if rank == 0:
                mean_ret = float(np.mean(eval_returns))
                std_ret = float(np.std(eval_returns))
                writer.add_scalar("eval/mean_return", mean_ret, global_step)
                writer.add_scalar("eval/std_return", std_ret, global_step)
                print(f"[{global_step}] eval over {args.eval_episodes} episodes: {mean_ret:.1f} +- {std_ret:.1f}")
                ckpt = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "update": update, "eval_return": mean_ret}
                torch.save(ckpt, os.path.join(args.run_dir, "last.pt"))
                if mean_ret > best_eval:
                    best_eval = mean_ret
                    torch.save(ckpt, os.path.join(args.run_dir, "best.pt"))
            dist.barrier()

    envs.close()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
