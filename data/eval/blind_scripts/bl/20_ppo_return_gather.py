"""
PPO on Atari (envpool) with DDP, logging the full distribution of episode
returns (median / p10 / p90 across all ranks) rather than only the mean.

    torchrun --nproc_per_node=8 20_ppo_return_gather.py --env-id Breakout-v5 --track
"""
import argparse
import os
import random
import time

import envpool
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributions.categorical import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="Breakout-v5")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=50_000_000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=16, help="per rank")
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.1)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--track", action="store_true")
    p.add_argument("--wandb-project", default="ppo-atari-ddp")
    p.add_argument("--save-path", default="checkpoints/ppo_atari.pt")
    return p.parse_args()


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(), layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU())
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def value(self, x):
        return self.critic(self.network(x / 255.0))

    def forward(self, x, action=None):
        hidden = self.network(x / 255.0)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = True

    if args.track and rank == 0:
        import wandb
        wandb.init(project=args.wandb_project, config={**vars(args), "world_size": world},
                   name=f"{args.env_id}-ppo-{world}x{args.num_envs}")

    envs = envpool.make(args.env_id, env_type="gymnasium", num_envs=args.num_envs,
                        episodic_life=True, reward_clip=True, seed=args.seed + 31 * rank)
    envs.num_envs = args.num_envs
    obs_shape = envs.single_observation_space.shape

    agent = DDP(Agent(envs.single_action_space.n).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)

    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_updates = args.total_timesteps // (batch_size * world)

    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)

    episode_return = np.zeros(args.num_envs, dtype=np.float32)
    global_step = 0
    start = time.time()
    o, _ = envs.reset()
    next_obs = torch.tensor(o, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)

    for update in range(1, num_updates + 1):
        optimizer.param_groups[0]["lr"] = args.lr * (1.0 - (update - 1.0) / num_updates)
        finished = []
        for step in range(args.num_steps):
            global_step += args.num_envs * world
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.module(next_obs)
                values[step] = value.flatten()
            actions[step], logprobs[step] = action, logprob
            o, reward, term, trunc, info = envs.step(action.cpu().numpy())
            rewards[step] = torch.tensor(reward, device=device)
            next_obs = torch.tensor(o, dtype=torch.float32, device=device)
            next_done = torch.tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
            episode_return += info["reward"]
            for i in np.nonzero(np.logical_or(term, trunc) & (info["lives"] == 0))[0]:
                finished.append(episode_return[i])
                episode_return[i] = 0.0

        with torch.no_grad():
            next_value = agent.module.value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal, nextvalues = 1.0 - next_done, next_value
                else:
                    nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1,) + obs_shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1).long()
        b_adv, b_ret, b_val = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)

        inds = np.arange(batch_size)
        for epoch in range(args.update_epochs):
            np.random.shuffle(inds)
            for s in range(0, batch_size, minibatch_size):
                mb = inds[s:s + minibatch_size]
                _, newlogprob, entropy, newvalue = agent(b_obs[mb], b_actions[mb])
                logratio = newlogprob - b_logprobs[mb]
                ratio = logratio.exp()
                mb_adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
                newvalue = newvalue.view(-1)
                v_clipped = b_val[mb] + torch.clamp(newvalue - b_val[mb], -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        # collect every finished episode from every rank for the return distribution
        local_returns = torch.tensor(finished, dtype=torch.float32, device=device)
        gathered = [torch.zeros_like(local_returns) for _ in range(world)]
        dist.all_gather(gathered, local_returns)
        all_returns = torch.cat(gathered).cpu().numpy()

        if rank == 0:
            sps = int(global_step / (time.time() - start))
            line = f"update {update}/{num_updates} step {global_step} sps {sps}"
            log = {"losses/policy": pg_loss.item(), "losses/value": v_loss.item(),
                   "losses/entropy": entropy.mean().item(), "charts/sps": sps,
                   "charts/lr": optimizer.param_groups[0]["lr"]}
            if len(all_returns) > 0:
                p10, p50, p90 = np.percentile(all_returns, [10, 50, 90])
                log.update({"returns/mean": float(all_returns.mean()), "returns/p10": p10,
                            "returns/median": p50, "returns/p90": p90, "returns/episodes": len(all_returns)})
                line += f" return mean {all_returns.mean():.1f} median {p50:.1f} (n={len(all_returns)})"
            print(line, flush=True)
            if args.track:
                wandb.log(log, step=global_step)
            if update % 100 == 0 or update == num_updates:
                os.makedirs(os.path.dirname(args.save_path) or ".", exist_ok=True)
                torch.save({"agent": agent.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "update": update, "global_step": global_step}, args.save_path)

    envs.close()
    if args.track and rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
