#!/usr/bin/env python3
"""DD-PPO for depth-only PointNav on Gibson with a small in-house vector env.

One process per GPU, each process steps its own set of habitat.Env workers.

    torchrun --nproc_per_node=8 train_pointnav.py --habitat-config configs/tasks/pointnav_gibson.yaml
"""
import argparse
import os
import random
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import habitat
from habitat.config.default import get_config as get_habitat_config


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--habitat-config", default="configs/tasks/pointnav_gibson.yaml")
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--total-steps", type=float, default=2.5e9)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--ppo-epochs", type=int, default=2)
    p.add_argument("--num-mini-batch", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--value-coef", type=float, default=0.5)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.95)
    p.add_argument("--sync-frac", type=float, default=0.6)
    p.add_argument("--obs-size", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ckpt-dir", default="checkpoints/pointnav_depth")
    p.add_argument("--ckpt-interval", type=int, default=250)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=100)
    return p.parse_args()


# --------------------------------------------------------------------------- envs
class NavRLEnv(habitat.RLEnv):
    def __init__(self, config, success_reward=2.5, slack_reward=-0.01):
        super().__init__(config)
        self._success_reward = success_reward
        self._slack_reward = slack_reward
        self._prev_dist = None

    def reset(self):
        obs = super().reset()
        self._prev_dist = self.habitat_env.get_metrics()["distance_to_goal"]
        return obs

    def get_reward_range(self):
        return (-10.0, 10.0)

    def get_reward(self, observations):
        m = self.habitat_env.get_metrics()
        reward = self._slack_reward + (self._prev_dist - m["distance_to_goal"])
        self._prev_dist = m["distance_to_goal"]
        if m["success"]:
            reward += self._success_reward
        return reward

    def get_done(self, observations):
        return self.habitat_env.episode_over

    def get_info(self, observations):
        return self.habitat_env.get_metrics()


def _env_worker(conn, cfg_path, scenes, seed, obs_size, gpu_id):
    cfg = get_habitat_config(cfg_path)
    cfg.defrost()
    cfg.DATASET.CONTENT_SCENES = scenes
    cfg.SIMULATOR.HABITAT_SIM_V0.GPU_DEVICE_ID = gpu_id
    cfg.SEED = seed
    cfg.freeze()
    env = NavRLEnv(cfg)
    env.seed(seed)
    device = torch.device("cuda", gpu_id)

    def prep(obs):
        # the sensor renders at 256x256; shrink on the GPU before shipping it back
        d = torch.as_tensor(obs["depth"], device=device).permute(2, 0, 1).unsqueeze(0)
        d = F.interpolate(d, size=(obs_size, obs_size), mode="area")
        return {"depth": d[0].permute(1, 2, 0).cpu().numpy(),
                "pointgoal_with_gps_compass": obs["pointgoal_with_gps_compass"]}

    try:
        while True:
            cmd, data = conn.recv()
            if cmd == "step":
                obs, rew, done, info = env.step(action=data)
                if done:
                    obs = env.reset()
                conn.send((prep(obs), rew, done, info))
            elif cmd == "reset":
                conn.send(prep(env.reset()))
            elif cmd == "close":
                break
    finally:
        env.close()
        conn.close()


class VectorEnv:
    def __init__(self, worker_args, ctx):
        self.conns, self.procs = [], []
        for args in worker_args:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_env_worker, args=(child, *args), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.num_envs = len(self.conns)

    def reset(self):
        for c in self.conns:
            c.send(("reset", None))
        return [c.recv() for c in self.conns]

    def step(self, actions):
        for c, a in zip(self.conns, actions):
            c.send(("step", int(a)))
        return list(zip(*[c.recv() for c in self.conns]))

    def close(self):
        for c in self.conns:
            c.send(("close", None))
        for p in self.procs:
            p.join()


def batch_obs(obs_list, device):
    return {k: torch.as_tensor(np.stack([o[k] for o in obs_list]), dtype=torch.float, device=device)
            for k in obs_list[0]}


# --------------------------------------------------------------------------- policy
class PointNavPolicy(nn.Module):
    def __init__(self, obs_size, hidden=512, num_actions=4):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 32, 8, stride=4), nn.ReLU(True),
            nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(True),
            nn.Conv2d(64, 32, 3, stride=1), nn.ReLU(True), nn.Flatten())
        with torch.no_grad():
            n_flat = self.cnn(torch.zeros(1, 1, obs_size, obs_size)).shape[1]
        self.visual_fc = nn.Sequential(nn.Linear(n_flat, hidden), nn.ReLU(True))
        self.goal_fc = nn.Linear(3, 32)
        self.prev_action_embed = nn.Embedding(num_actions + 1, 32)
        self.rnn = nn.GRU(hidden + 64, hidden)
        self.actor = nn.Linear(hidden, num_actions)
        self.critic = nn.Linear(hidden, 1)
        self.hidden_size = hidden

    def _features(self, obs, h, prev_actions, masks):
        x = self.visual_fc(self.cnn(obs["depth"].permute(0, 3, 1, 2)))
        g = obs["pointgoal_with_gps_compass"]
        g = torch.stack([g[:, 0], torch.cos(-g[:, 1]), torch.sin(-g[:, 1])], -1)
        pa = self.prev_action_embed(((prev_actions.squeeze(-1) + 1) * masks.squeeze(-1)).long())
        x = torch.cat([x, F.relu(self.goal_fc(g)), pa], -1)
        n = h.size(1)
        t = x.size(0) // n
        x, masks = x.view(t, n, -1), masks.view(t, n, 1)
        outs = []
        for i in range(t):
            o, h = self.rnn(x[i:i + 1], h * masks[i].view(1, n, 1))
            outs.append(o)
        return torch.cat(outs, 0).view(t * n, -1), h

    @torch.no_grad()
    def act(self, obs, h, prev_actions, masks, deterministic=False):
        feats, h = self._features(obs, h, prev_actions, masks)
        dist_ = torch.distributions.Categorical(logits=self.actor(feats))
        action = dist_.probs.argmax(-1) if deterministic else dist_.sample()
        return self.critic(feats), action.unsqueeze(-1), dist_.log_prob(action).unsqueeze(-1), h

    def forward(self, obs, h, prev_actions, masks, actions):
        feats, _ = self._features(obs, h, prev_actions, masks)
        dist_ = torch.distributions.Categorical(logits=self.actor(feats))
        return (self.critic(feats), dist_.log_prob(actions.squeeze(-1)).unsqueeze(-1),
                dist_.entropy().mean())


# --------------------------------------------------------------------------- storage
class RolloutStorage:
    def __init__(self, T, N, obs_size, hidden, device):
        self.obs = {"depth": torch.zeros(T + 1, N, obs_size, obs_size, 1, device=device),
                    "pointgoal_with_gps_compass": torch.zeros(T + 1, N, 2, device=device)}
        self.hidden = torch.zeros(T + 1, 1, N, hidden, device=device)
        self.rewards = torch.zeros(T, N, 1, device=device)
        self.values = torch.zeros(T + 1, N, 1, device=device)
        self.returns = torch.zeros(T + 1, N, 1, device=device)
        self.log_probs = torch.zeros(T, N, 1, device=device)
        self.actions = torch.zeros(T, N, 1, dtype=torch.long, device=device)
        self.prev_actions = torch.zeros(T + 1, N, 1, dtype=torch.long, device=device)
        self.masks = torch.zeros(T + 1, N, 1, device=device)
        self.step = 0

    def insert(self, obs, h, actions, log_probs, values, rewards, masks):
        s = self.step
        for k in obs:
            self.obs[k][s + 1].copy_(obs[k])
        self.hidden[s + 1].copy_(h)
        self.actions[s].copy_(actions)
        self.prev_actions[s + 1].copy_(actions)
        self.log_probs[s].copy_(log_probs)
        self.values[s].copy_(values)
        self.rewards[s].copy_(rewards)
        self.masks[s + 1].copy_(masks)
        self.step += 1

    def compute_returns(self, next_value, gamma, tau):
        T = self.step
        self.values[T] = next_value
        gae = 0.0
        for t in reversed(range(T)):
            delta = self.rewards[t] + gamma * self.values[t + 1] * self.masks[t + 1] - self.values[t]
            gae = delta + gamma * tau * self.masks[t + 1] * gae
            self.returns[t] = gae + self.values[t]

    def minibatches(self, adv, num_mini_batch):
        T, N = self.step, self.rewards.size(1)
        perm = torch.randperm(N)
        per = N // num_mini_batch
        for start in range(0, N, per):
            idx = perm[start:start + per]
            yield ({k: v[:T, idx].flatten(0, 1) for k, v in self.obs.items()},
                   self.hidden[0, :, idx], self.prev_actions[:T, idx].flatten(0, 1),
                   self.masks[:T, idx].flatten(0, 1), self.actions[:T, idx].flatten(0, 1),
                   self.log_probs[:T, idx].flatten(0, 1), self.returns[:T, idx].flatten(0, 1),
                   adv[:T, idx].flatten(0, 1))

    def after_update(self):
        T = self.step
        for k in self.obs:
            self.obs[k][0].copy_(self.obs[k][T])
        self.hidden[0].copy_(self.hidden[T])
        self.prev_actions[0].copy_(self.prev_actions[T])
        self.masks[0].copy_(self.masks[T])
        self.step = 0


# --------------------------------------------------------------------------- main
def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    policy = PointNavPolicy(args.obs_size, args.hidden).to(device)
    model = DDP(policy, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)

    hcfg = get_habitat_config(args.habitat_config)
    scenes = sorted(habitat.make_dataset(hcfg.DATASET.TYPE).get_scenes_to_load(hcfg.DATASET))
    my_scenes = scenes[rank::world]
    per_env = [my_scenes[i::args.num_envs] for i in range(args.num_envs)]
    worker_args = [(args.habitat_config, per_env[i], args.seed + rank * args.num_envs + i,
                    args.obs_size, local_rank) for i in range(args.num_envs)]
    ctx = mp.get_context("fork")
    envs = VectorEnv(worker_args, ctx)

    tracker = dist.PrefixStore("rollout_tracker", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0))
    tracker.set("num_done", "0")
    dist.barrier()

    rollouts = RolloutStorage(args.num_steps, args.num_envs, args.obs_size, args.hidden, device)
    obs = batch_obs(envs.reset(), device)
    for k in obs:
        rollouts.obs[k][0].copy_(obs[k])

    window = {"reward": deque(maxlen=50), "success": deque(maxlen=50), "spl": deque(maxlen=50)}
    ep_reward = torch.zeros(args.num_envs, 1, device=device)
    count_steps, update, t_start = 0, 0, time.time()
    os.makedirs(args.ckpt_dir, exist_ok=True)

    while count_steps < args.total_steps:
        for g in optimizer.param_groups:
            g["lr"] = args.lr * (1 - count_steps / args.total_steps)

        steps_this_rollout = 0
        for step in range(args.num_steps):
            s = rollouts.step
            values, actions, log_probs, h = policy.act(
                {k: v[s] for k, v in rollouts.obs.items()}, rollouts.hidden[s],
                rollouts.prev_actions[s], rollouts.masks[s])
            obs, rews, dones, infos = envs.step(actions.squeeze(-1).tolist())
            rews = torch.tensor(rews, dtype=torch.float, device=device).unsqueeze(-1)
            masks = torch.tensor([[0.0] if d else [1.0] for d in dones], device=device)
            ep_reward += rews
            for i, d in enumerate(dones):
                if d:
                    window["reward"].append(ep_reward[i].item())
                    window["success"].append(float(infos[i]["success"]))
                    window["spl"].append(float(infos[i]["spl"]))
            ep_reward *= masks
            rollouts.insert(batch_obs(obs, device), h, actions, log_probs, values, rews, masks)
            steps_this_rollout += 1
            if step + 1 >= args.num_steps // 4 and int(tracker.get("num_done")) >= args.sync_frac * world:
                break
        tracker.add("num_done", 1)

        s = rollouts.step
        with torch.no_grad():
            next_value = policy.act({k: v[s] for k, v in rollouts.obs.items()}, rollouts.hidden[s],
                                    rollouts.prev_actions[s], rollouts.masks[s])[0]
        rollouts.compute_returns(next_value, args.gamma, args.tau)

        adv = rollouts.returns[:s] - rollouts.values[:s]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        for _ in range(args.ppo_epochs):
            for ob, h0, pa, m, a, old_lp, ret, ad in rollouts.minibatches(adv, args.num_mini_batch):
                values, lp, ent = model(ob, h0, pa, m, a)
                ratio = torch.exp(lp - old_lp)
                a_loss = -torch.min(ratio * ad, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * ad).mean()
                v_loss = 0.5 * (ret - values).pow(2).mean()
                loss = args.value_coef * v_loss + a_loss - args.entropy_coef * ent
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.2)
                optimizer.step()
        rollouts.after_update()

        counts = torch.tensor([steps_this_rollout * args.num_envs], dtype=torch.float, device=device)
        dist.all_reduce(counts)
        count_steps += int(counts.item())
        if rank == 0:
            tracker.set("num_done", "0")
        update += 1

        stats = torch.tensor([sum(window[k]) for k in ("reward", "success", "spl")] + [len(window["reward"])],
                             dtype=torch.float, device=device)
        dist.all_reduce(stats)
        stats = stats[:3] / stats[3].clamp(min=1)
        if rank == 0 and update % args.log_interval == 0:
            print(f"update {update}  frames {count_steps:.3e}  fps {count_steps / (time.time() - t_start):.0f}  "
                  f"reward {stats[0]:.3f}  success {stats[1]:.3f}  spl {stats[2]:.3f}  loss {loss.item():.4f}",
                  flush=True)
        if rank == 0 and update % args.ckpt_interval == 0:
            torch.save({"state_dict": policy.state_dict(), "optimizer": optimizer.state_dict(),
                        "update": update, "count_steps": count_steps},
                       os.path.join(args.ckpt_dir, f"ckpt.{update // args.ckpt_interval}.pth"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
