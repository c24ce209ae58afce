#!/usr/bin/env python3
"""Stand-alone DD-PPO trainer for PointNav (RGB-D, ResNet18 + LSTM).

Trimmed-down copy of habitat_baselines' DD-PPO trainer so that we can hack on the
update without touching the library. Launch with torchrun, e.g. 2 nodes x 8 GPUs:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 ddppo_train.py \
        --exp-config configs/ddppo_pointnav.yaml
"""
import argparse
import os
import random
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as distrib
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.obs_transformers import (
    apply_obs_transforms_batch, apply_obs_transforms_obs_space, get_active_obs_transforms)
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.common.tensorboard_utils import TensorboardWriter
from habitat_baselines.config.default import get_config
from habitat_baselines.rl.ddppo.policy import PointNavResNetPolicy
from habitat_baselines.utils.common import batch_obs, linear_decay


class _EvalActionsWrapper(nn.Module):
    """DDP only hooks into forward(), so route evaluate_actions through it."""

    def __init__(self, actor_critic):
        super().__init__()
        self.actor_critic = actor_critic

    def forward(self, *args, **kwargs):
        return self.actor_critic.evaluate_actions(*args, **kwargs)


class DDPPOTrainer:
    SHORT_ROLLOUT_THRESHOLD = 0.25

    def __init__(self, config):
        self.config = config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.world_rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.device = torch.device("cuda", self.local_rank)

    # ------------------------------------------------------------------ setup
    def _init_distributed(self):
        torch.cuda.set_device(self.device)
        distrib.init_process_group(backend=self.config.RL.DDPPO.distrib_backend)
        # separate store for the straggler counter, one port above the rendezvous port
        tcp_store = distrib.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                                     self.world_size, self.world_rank == 0)
        self.num_rollouts_done_store = distrib.PrefixStore("rollout_tracker", tcp_store)
        self.num_rollouts_done_store.set("num_done", "0")

        self.config.defrost()
        self.config.TORCH_GPU_ID = self.local_rank
        self.config.SIMULATOR_GPU_ID = self.local_rank
        # different envs on every rank; each rank shuffles the scene list with its own seed
        self.config.TASK_CONFIG.SEED += self.world_rank * self.config.NUM_ENVIRONMENTS
        self.config.freeze()
        random.seed(self.config.TASK_CONFIG.SEED)
        np.random.seed(self.config.TASK_CONFIG.SEED)
        torch.manual_seed(self.config.TASK_CONFIG.SEED)

    def _setup_actor_critic(self):
        ppo_cfg = self.config.RL.PPO
        self.obs_transforms = get_active_obs_transforms(self.config)
        obs_space = apply_obs_transforms_obs_space(self.envs.observation_spaces[0], self.obs_transforms)
        self.actor_critic = PointNavResNetPolicy.from_config(self.config, obs_space, self.envs.action_spaces[0])
        self.actor_critic.to(self.device)
        if self.config.RL.DDPPO.pretrained:
            state = torch.load(self.config.RL.DDPPO.pretrained_weights, map_location="cpu")
            self.actor_critic.load_state_dict(
                {k[len("actor_critic."):]: v for k, v in state["state_dict"].items()})
        self.ddp_eval = nn.parallel.DistributedDataParallel(
            _EvalActionsWrapper(self.actor_critic), device_ids=[self.device], output_device=self.device)
        self.optimizer = torch.optim.Adam(self.actor_critic.parameters(), lr=ppo_cfg.lr, eps=ppo_cfg.eps)
        self.obs_space = obs_space

    # ------------------------------------------------------------------ ppo
    def _update_agent(self, rollouts):
        ppo_cfg = self.config.RL.PPO
        with torch.no_grad():
            step_batch = rollouts.buffers[rollouts.current_rollout_step_idx]
            next_value = self.actor_critic.get_value(
                step_batch["observations"], step_batch["recurrent_hidden_states"],
                step_batch["prev_actions"], step_batch["masks"])
        rollouts.compute_returns(next_value, ppo_cfg.use_gae, ppo_cfg.gamma, ppo_cfg.tau)

        t = rollouts.current_rollout_step_idx
        advantages = rollouts.buffers["returns"][:t] - rollouts.buffers["value_preds"][:t]
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-5)
        self.actor_critic.train()
        totals = defaultdict(float)
        for _ in range(ppo_cfg.ppo_epoch):
            for batch in rollouts.recurrent_generator(advantages, ppo_cfg.num_mini_batch):
                values, log_probs, entropy, _ = self.ddp_eval(
                    batch["observations"], batch["recurrent_hidden_states"],
                    batch["prev_actions"], batch["masks"], batch["actions"])
                ratio = torch.exp(log_probs - batch["action_log_probs"])
                surr1 = ratio * batch["advantages"]
                surr2 = torch.clamp(ratio, 1.0 - ppo_cfg.clip_param, 1.0 + ppo_cfg.clip_param) * batch["advantages"]
                action_loss = -torch.min(surr1, surr2).mean()
                value_loss = 0.5 * (batch["returns"] - values).pow(2).mean()
                loss = value_loss * ppo_cfg.value_loss_coef + action_loss - entropy * ppo_cfg.entropy_coef
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.actor_critic.parameters(), ppo_cfg.max_grad_norm)
                self.optimizer.step()
                totals["value_loss"] += value_loss.item()
                totals["action_loss"] += action_loss.item()
                totals["entropy"] += entropy.item()
        n = ppo_cfg.ppo_epoch * ppo_cfg.num_mini_batch
        rollouts.after_update()
        return {k: v / n for k, v in totals.items()}

    def _should_end_early(self, step):
        return (step >= self.config.RL.PPO.num_steps * self.SHORT_ROLLOUT_THRESHOLD
                and int(self.num_rollouts_done_store.get("num_done"))
                >= self.config.RL.DDPPO.sync_frac * self.world_size)

    def _all_reduce(self, t):
        t = t.to(self.device)
        distrib.all_reduce(t)
        return t

    # ------------------------------------------------------------------ main loop
    def train(self):
        self._init_distributed()
        ppo_cfg = self.config.RL.PPO
        self.envs = construct_envs(self.config, get_env_class(self.config.ENV_NAME))
        self._setup_actor_critic()
        if self.world_rank == 0:
            os.makedirs(self.config.CHECKPOINT_FOLDER, exist_ok=True)
            logger.info("agent number of parameters: {}".format(
                sum(p.numel() for p in self.actor_critic.parameters())))

        rollouts = RolloutStorage(
            ppo_cfg.num_steps, self.envs.num_envs, self.obs_space, self.envs.action_spaces[0],
            ppo_cfg.hidden_size, num_recurrent_layers=self.actor_critic.net.num_recurrent_layers)
        rollouts.to(self.device)

        obs = self.envs.reset()
        batch = apply_obs_transforms_batch(batch_obs(obs, device=self.device), self.obs_transforms)
        rollouts.buffers["observations"][0] = batch

        current_episode_reward = torch.zeros(self.envs.num_envs, 1, device=self.device)
        running = dict(count=torch.zeros(self.envs.num_envs, 1, device=self.device),
                       reward=torch.zeros(self.envs.num_envs, 1, device=self.device))
        window = defaultdict(lambda: deque(maxlen=ppo_cfg.reward_window_size))
        lr_scheduler = LambdaLR(self.optimizer, lambda x: linear_decay(x, self.config.NUM_UPDATES))

        count_steps, t_start = 0, time.time()
        writer = TensorboardWriter(self.config.TENSORBOARD_DIR) if self.world_rank == 0 else None
        for update in range(self.config.NUM_UPDATES):
            if ppo_cfg.use_linear_lr_decay:
                lr_scheduler.step()
            count_steps_delta = 0
            self.actor_critic.eval()
            for step in range(ppo_cfg.num_steps):
                idx = rollouts.current_rollout_step_idx
                with torch.no_grad():
                    step_batch = rollouts.buffers[idx]
                    values, actions, log_probs, hidden = self.actor_critic.act(
                        step_batch["observations"], step_batch["recurrent_hidden_states"],
                        step_batch["prev_actions"], step_batch["masks"])
                outputs = self.envs.step([a.item() for a in actions.cpu()])
                obs, rewards_l, dones, infos = [list(x) for x in zip(*outputs)]
                batch = apply_obs_transforms_batch(batch_obs(obs, device=self.device), self.obs_transforms)
                rewards = torch.tensor(rewards_l, dtype=torch.float, device=self.device).unsqueeze(1)
                not_done = torch.tensor([[not d] for d in dones], dtype=torch.bool, device=self.device)
                current_episode_reward += rewards
                done_f = (~not_done).float()
                running["reward"] += done_f * current_episode_reward
                running["count"] += done_f
                for i, d in enumerate(dones):
                    if d:
                        for k in ("success", "spl", "distance_to_goal"):
                            window[k].append(float(infos[i][k]))
                current_episode_reward *= not_done.float()
                rollouts.insert(next_observations=batch, rewards=rewards, next_masks=not_done,
                                actions=actions, action_log_probs=log_probs, value_preds=values,
                                next_recurrent_hidden_states=hidden)
                rollouts.advance_rollout()
                count_steps_delta += self.envs.num_envs
                if self._should_end_early(step + 1):
                    break
            self.num_rollouts_done_store.add("num_done", 1)

            losses = self._update_agent(rollouts)
            if self.world_rank == 0:
                self.num_rollouts_done_store.set("num_done", "0")

            stats = self._all_reduce(torch.tensor(
                [running["reward"].sum().item(), running["count"].sum().item(), float(count_steps_delta)]
                + [sum(window[k]) for k in ("success", "spl")] + [float(len(window["success"]))]))
            loss_t = self._all_reduce(torch.tensor([losses["value_loss"], losses["action_loss"]])) / self.world_size
            count_steps += int(stats[2].item())
            if self.world_rank == 0 and update % self.config.LOG_INTERVAL == 0:
                n_ep = max(stats[5].item(), 1.0)
                metrics = {"reward": (stats[0] / stats[1].clamp(min=1)).item(),
                           "success": stats[3].item() / n_ep, "spl": stats[4].item() / n_ep}
                writer.add_scalars("metrics", metrics, count_steps)
                writer.add_scalars("losses", {"value": loss_t[0].item(), "policy": loss_t[1].item()}, count_steps)
                logger.info("update: {}\tfps: {:.1f}\tframes: {}\t{}".format(
                    update, count_steps / (time.time() - t_start), count_steps, metrics))
            if update > 0 and update % self.config.CHECKPOINT_INTERVAL == 0:
                if self.world_rank == 0:
                    torch.save({"state_dict": self.actor_critic.state_dict(), "config": self.config,
                                "optim_state": self.optimizer.state_dict(), "count_steps": count_steps},
                               os.path.join(self.config.CHECKPOINT_FOLDER,
                                            f"ckpt.{update // self.config.CHECKPOINT_INTERVAL}.pth"))
                distrib.barrier()

        self.envs.close()
        if writer is not None:
            writer.close()
        distrib.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--exp-config", required=True)
    parser.add_argument("opts", nargs=argparse.REMAINDER, default=None)
    args = parser.parse_args()
    config = get_config(args.exp_config, args.opts)
    DDPPOTrainer(config).train()


if __name__ == "__main__":
    main()
