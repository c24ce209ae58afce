"""
PPO (clipped objective, GAE) with DistributedDataParallel.

--num-envs is the total over all GPUs: every rank steps num_envs / world_size
environments and keeps its own rollout storage, and DDP averages the
gradients, so the batch per update (num_envs * num_steps) and therefore the
learning-rate schedule are the same as in the single-GPU run.

    torchrun --standalone --nproc_per_node=4 01_ppo_cartpole_ddp.py --env-id LunarLander-v2
"""
import argparse
import os
import random
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def str2bool(v):
    return str(v).lower() in ("1", "true", "yes", "y")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--exp-name", type=str, default="ppo_ddp")
    p.add_argument("--env-id", type=str, default="LunarLander-v2")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=4_000_000)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=32, help="environments in total, split across ranks")
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--anneal-lr", type=str2bool, default=True)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--target-kl", type=float, default=0.02)
    p.add_argument("--save-dir", type=str, default="checkpoints")
    p.add_argument("--save-every", type=int, default=50, help="updates between checkpoints")
    p.add_argument("--resume", type=str, default=None)
    return p.parse_args()


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x):
        return self.critic(x)

    def forward(self, x, action=None):
        logits = self.actor(x)
        dist_ = Categorical(logits=logits)
        if action is None:
            action = dist_.sample()
        return action, dist_.log_prob(action), dist_.entropy(), self.critic(x)


def make_env(env_id, seed):
    def thunk():
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env.action_space.seed(seed)
        return env
    return thunk


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.num_envs % world_size == 0, "--num-envs must be divisible by the number of GPUs"
    args.num_envs //= world_size  # from here on: environments on this rank

    # different seeds per rank so the environments do not all replay the same episodes;
    # DDP broadcasts rank 0's initial weights, so the networks still start identical
    seed = args.seed + 1000 * rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}") if rank == 0 else None

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, seed + i) for i in range(args.num_envs)])
    assert isinstance(envs.single_action_space, gym.spaces.Discrete)
    obs_dim = int(np.prod(envs.single_observation_space.shape))

    agent = Agent(obs_dim, envs.single_action_space.n).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    start_update = 1
    global_step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        agent.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_update = ckpt["update"] + 1
        global_step = ckpt["global_step"]

    agent = DDP(agent, device_ids=[local_rank])

    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_updates = args.total_timesteps // (batch_size * world_size)

    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim), device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)

    next_obs, _ = envs.reset(seed=seed)
    next_obs = torch.as_tensor(next_obs, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)
    start_time = time.time()

    for update in range(start_update, num_updates + 1):
        if args.anneal_lr:
            frac = 1.0 - (update - 1.0) / num_updates
            optimizer.param_groups[0]["lr"] = frac * args.learning_rate

        ep_returns, ep_lengths = [], []
        for step in range(args.num_steps):
            global_step += args.num_envs * world_size
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.module(next_obs)
            values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob

            o, r, term, trunc, infos = envs.step(action.cpu().numpy())
            rewards[step] = torch.as_tensor(r, dtype=torch.float32, device=device)
            next_obs = torch.as_tensor(o, dtype=torch.float32, device=device)
            next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32, device=device)
            if "final_info" in infos:
                for info in infos["final_info"]:
                    if info and "episode" in info:
                        ep_returns.append(float(info["episode"]["r"]))
                        ep_lengths.append(float(info["episode"]["l"]))

        with torch.no_grad():
            next_value = agent.module.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1, obs_dim))
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        b_inds = np.arange(batch_size)
        clipfracs = []
        stop_early = False
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = b_inds[start:start + minibatch_size]
                _, newlogprob, entropy, newvalue = agent(b_obs[mb_inds], b_actions.long()[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()

                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())

                mb_adv = b_advantages[mb_inds]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)

                pg_loss1 = -mb_adv * ratio
                pg_loss2 = -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
                pg_loss = torch.max(pg_loss1, pg_loss2).mean()

                newvalue = newvalue.view(-1)
                v_clipped = b_values[mb_inds] + torch.clamp(
                    newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_returns[mb_inds]) ** 2,
                                         (v_clipped - b_returns[mb_inds]) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

            if args.target_kl is not None:
                # every rank must take the same decision, otherwise the ranks run a
                # different number of backward passes
                kl = approx_kl.detach().clone()
                dist.all_reduce(kl, op=dist.ReduceOp.SUM)
                kl /= world_size
                if kl.item() > args.target_kl:
                    stop_early = True
            if stop_early:
                break

        y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

        stats = torch.tensor([sum(ep_returns), sum(ep_lengths), len(ep_returns)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        if rank == 0:
            sps = int((global_step - (start_update - 1) * batch_size * world_size) / (time.time() - start_time))
            writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], global_step)
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
            writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
            writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
            writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
            writer.add_scalar("losses/explained_variance", explained_var, global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            if stats[2] > 0:
                mean_ret = (stats[0] / stats[2]).item()
                writer.add_scalar("charts/episodic_return", mean_ret, global_step)
                writer.add_scalar("charts/episodic_length", (stats[1] / stats[2]).item(), global_step)
                print(f"update {update}/{num_updates} step {global_step} return {mean_ret:.1f} SPS {sps}")

        if update % args.save_every == 0 or update == num_updates:
            if rank == 0:
                os.makedirs(args.save_dir, exist_ok=True)
                torch.save({
                    "model": agent.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "update": update,
                    "global_step": global_step,
                    "args": vars(args),
                }, os.path.join(args.save_dir, f"{args.exp_name}_latest.pt"))
            dist.barrier()

    envs.close()
    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
