# PPO + IMPALA-CNN on Procgen, multi-GPU by hand: every rank collects with its own
# ProcgenEnv, gradients are flattened and all-reduced once per minibatch.
# (cleanrl ppo_procgen + the multigpu trick from ppo_atari_multigpu)
#
#   torchrun --standalone --nproc_per_node=4 18_ppo_procgen_allreduce.py --env-id starpilot
import argparse
import os
import random
import time

import gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from procgen import ProcgenEnv
from torch.distributions.categorical import Categorical
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="starpilot")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=25_000_000)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--local-num-envs", type=int, default=64)
    p.add_argument("--num-steps", type=int, default=256)
    p.add_argument("--gamma", type=float, default=0.999)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=8)
    p.add_argument("--update-epochs", type=int, default=3)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--logdir", default="runs")
    return p.parse_args()


class ResidualBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv0 = nn.Conv2d(c, c, 3, padding=1)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv1(nn.functional.relu(self.conv0(nn.functional.relu(x))))


class ConvSequence(nn.Module):
    def __init__(self, shape, out_c):
        super().__init__()
        self._shape, self._out = shape, out_c
        self.conv = nn.Conv2d(shape[0], out_c, 3, padding=1)
        self.res0, self.res1 = ResidualBlock(out_c), ResidualBlock(out_c)

    def forward(self, x):
        x = nn.functional.max_pool2d(self.conv(x), kernel_size=3, stride=2, padding=1)
        return self.res1(self.res0(x))

    def get_output_shape(self):
        _, h, w = self._shape
        return self._out, (h + 1) // 2, (w + 1) // 2


class Agent(nn.Module):
    def __init__(self, obs_shape, n_actions):
        super().__init__()
        h, w, c = obs_shape
        shape = (c, h, w)
        seqs = []
        for out_c in [16, 32, 32]:
            s = ConvSequence(shape, out_c)
            shape = s.get_output_shape()
            seqs.append(s)
        self.network = nn.Sequential(*seqs, nn.Flatten(), nn.ReLU(),
                                     nn.Linear(shape[0] * shape[1] * shape[2], 256), nn.ReLU())
        self.actor = nn.Linear(256, n_actions)
        self.critic = nn.Linear(256, 1)

    def get_value(self, x):
        return self.critic(self.network(x.permute(0, 3, 1, 2) / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x.permute(0, 3, 1, 2) / 255.0)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def make_envs(args, seed):
    envs = ProcgenEnv(num_envs=args.local_num_envs, env_name=args.env_id, num_levels=0, start_level=0,
                      distribution_mode="easy", rand_seed=seed)
    envs = gym.wrappers.TransformObservation(envs, lambda obs: obs["rgb"])
    envs.single_action_space = envs.action_space
    envs.single_observation_space = envs.observation_space["rgb"]
    envs.is_vector_env = True
    envs = gym.wrappers.RecordEpisodeStatistics(envs)
    envs = gym.wrappers.NormalizeReward(envs, gamma=args.gamma)
    envs = gym.wrappers.TransformReward(envs, lambda r: np.clip(r, -10, 10))
    return envs


def allreduce_grads(params, world_size):
    grads = [p.grad.view(-1) for p in params if p.grad is not None]
    flat = torch.cat(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for p in params:
        if p.grad is not None:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    batch_size = args.local_num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_updates = args.total_timesteps // (batch_size * world)

    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    writer = SummaryWriter(os.path.join(args.logdir, f"procgen_{args.env_id}_{args.seed}_{int(time.time())}")) \
        if rank == 0 else None

    envs = make_envs(args, seed)
    agent = Agent(envs.single_observation_space.shape, envs.single_action_space.n).to(device)
    params = list(agent.parameters())
    for p in params:
        dist.broadcast(p.data, src=0)
    optimizer = optim.Adam(params, lr=args.learning_rate, eps=1e-5)

    obs_shape = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, args.local_num_envs) + obs_shape, device=device)
    actions = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    logprobs = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.local_num_envs), device=device)
    values = torch.zeros((args.num_steps, args.local_num_envs), device=device)

    global_step, start = 0, time.time()
    next_obs = torch.Tensor(envs.reset()).to(device)
    next_done = torch.zeros(args.local_num_envs, device=device)
    ep_returns = []

    for update in range(1, num_updates + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (update - 1.0) / num_updates) * args.learning_rate
        for step in range(args.num_steps):
            global_step += args.local_num_envs * world
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
            values[step], actions[step], logprobs[step] = value.flatten(), action, logprob
            o, r, d, info = envs.step(action.cpu().numpy())
            rewards[step] = torch.tensor(r, device=device).view(-1)
            next_obs, next_done = torch.Tensor(o).to(device), torch.Tensor(d).to(device)
            for item in info:
                if "episode" in item:
                    ep_returns.append(item["episode"]["r"])

        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(args.num_steps)):
                nnt = 1.0 - (next_done if t == args.num_steps - 1 else dones[t + 1])
                nv = next_value if t == args.num_steps - 1 else values[t + 1]
                delta = rewards[t] + args.gamma * nv * nnt - values[t]
                advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nnt * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1,) + obs_shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape(-1)
        b_adv, b_ret, b_val = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)

        b_inds = np.arange(batch_size)
        for _ in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for s in range(0, batch_size, minibatch_size):
                mb = b_inds[s:s + minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions.long()[mb])
                ratio = (newlogprob - b_logprobs[mb]).exp()
                adv = (b_adv[mb] - b_adv[mb].mean()) / (b_adv[mb].std() + 1e-8)
                pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
                newvalue = newvalue.view(-1)
                v_clipped = b_val[mb] + (newvalue - b_val[mb]).clamp(-args.clip_coef, args.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + args.vf_coef * v_loss

                optimizer.zero_grad()
                loss.backward()
                if world > 1:
                    allreduce_grads(params, world)
                nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                optimizer.step()

        stats = torch.tensor([float(np.sum(ep_returns)), float(len(ep_returns))], device=device)
        dist.all_reduce(stats)
        ep_returns.clear()
        if rank == 0:
            sps = int(global_step / (time.time() - start))
            mean_ret = (stats[0] / stats[1]).item() if stats[1] > 0 else float("nan")
            writer.add_scalar("charts/episodic_return", mean_ret, global_step)
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
            writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("charts/SPS", sps, global_step)
            print(f"update {update}/{num_updates} step {global_step} return {mean_ret:.2f} SPS {sps}", flush=True)
            if update % 100 == 0 or update == num_updates:
                torch.save(agent.state_dict(), os.path.join(writer.log_dir, f"agent_{update}.pt"))

    envs.close()
    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
