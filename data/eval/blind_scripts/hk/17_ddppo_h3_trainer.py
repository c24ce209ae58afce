"""DD-PPO trainer on habitat-lab 0.3 (hydra configs), trimmed for our ImageNav/PointNav runs.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        ddppo_h3.py --config-name=pointnav/ddppo_pointnav.yaml \
        habitat_baselines.checkpoint_folder=/checkpoint/$USER/pn_h3
"""
import os
import sys
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import open_dict

from habitat import logger
from habitat_baselines.common.baseline_registry import baseline_registry
from habitat_baselines.common.construct_vector_env import construct_envs
from habitat_baselines.common.rollout_storage import RolloutStorage
from habitat_baselines.common.tensorboard_utils import TensorboardWriter
from habitat_baselines.config.default import get_config
from habitat_baselines.utils.common import batch_obs

SHORT_ROLLOUT_THRESHOLD = 0.25


class _EvalActionsWrapper(nn.Module):
    def __init__(self, ac):
        super().__init__()
        self.ac = ac

    def forward(self, *args, **kwargs):
        return self.ac.evaluate_actions(*args, **kwargs)


class Trainer:
    def __init__(self, config):
        self.config = config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(config.habitat_baselines.rl.ddppo.distrib_backend)
        self.world_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                              self.world_size, self.world_rank == 0)
        self.num_done_store = dist.PrefixStore("rollout_tracker", store)
        self.num_done_store.set("num_done", "0")
        with open_dict(config):
            config.habitat_baselines.torch_gpu_id = self.local_rank
            config.habitat.simulator.habitat_sim_v0.gpu_device_id = self.local_rank
            config.habitat.seed += self.world_rank * config.habitat_baselines.num_environments

    def _coalesce_and_reduce(self, values):
        keys = sorted(values.keys())
        t = torch.tensor([float(values[k]) for k in keys], device=self.device)
        dist.all_reduce(t)
        t /= self.world_size
        return dict(zip(keys, t.tolist()))

    def _update(self, rollouts):
        ppo = self.config.habitat_baselines.rl.ppo
        T = rollouts.current_rollout_step_idx
        with torch.no_grad():
            b = rollouts.buffers[T]
            nv = self.actor_critic.get_value(b["observations"], b["recurrent_hidden_states"], b["prev_actions"],
                                             b["masks"])
        rollouts.compute_returns(nv, ppo.use_gae, ppo.gamma, ppo.tau)
        adv = rollouts.buffers["returns"][:T] - rollouts.buffers["value_preds"][:T]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        self.actor_critic.train()
        losses = defaultdict(float)
        for _ in range(ppo.ppo_epoch):
            for mb in rollouts.recurrent_generator(adv, ppo.num_mini_batch):
                out = self.ddp_eval(mb["observations"], mb["recurrent_hidden_states"], mb["prev_actions"],
                                    mb["masks"], mb["actions"], mb["rnn_build_seq_info"])
                values, logp, ent = out[0], out[1], out[2]
                ratio = torch.exp(logp - mb["action_log_probs"])
                pg = -torch.min(ratio * mb["advantages"],
                                ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb["advantages"]).mean()
                vl = 0.5 * (mb["returns"] - values).pow(2).mean()
                ent = ent.mean()
                self.optimizer.zero_grad()
                (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                nn.utils.clip_grad_norm_(self.actor_critic.parameters(), ppo.max_grad_norm)
                self.optimizer.step()
                losses["value_loss"] += vl.item()
                losses["action_loss"] += pg.item()
                losses["entropy"] += ent.item()
        rollouts.after_update()
        n = ppo.ppo_epoch * ppo.num_mini_batch
        return {k: v / n for k, v in losses.items()}

    def train(self):
        cfg = self.config
        hb, ppo = cfg.habitat_baselines, cfg.habitat_baselines.rl.ppo
        self.envs = construct_envs(cfg, workers_ignore_signals=False, is_first_rank=self.world_rank == 0)
        obs_space, act_space = self.envs.observation_spaces[0], self.envs.action_spaces[0]
        policy_cls = baseline_registry.get_policy(hb.rl.policy.main_agent.name)
        self.actor_critic = policy_cls.from_config(cfg, obs_space, act_space).to(self.device)
        self.ddp_eval = nn.parallel.DistributedDataParallel(
            _EvalActionsWrapper(self.actor_critic), device_ids=[self.device], output_device=self.device)
        self.optimizer = torch.optim.Adam(self.actor_critic.parameters(), lr=ppo.lr, eps=ppo.eps)

        rollouts = RolloutStorage(ppo.num_steps, self.envs.num_envs, obs_space, act_space, ppo.hidden_size,
                                  num_recurrent_layers=self.actor_critic.num_recurrent_layers,
                                  is_double_buffered=False)
        rollouts.to(self.device)
        rollouts.buffers["observations"][0] = batch_obs(self.envs.reset(), device=self.device)
        ep_rew = torch.zeros(self.envs.num_envs, 1, device=self.device)
        window = defaultdict(lambda: deque(maxlen=ppo.reward_window_size))
        writer = TensorboardWriter(hb.tensorboard_dir, flush_secs=30) if self.world_rank == 0 else None
        count_steps, t0 = 0, time.time()
        if self.world_rank == 0:
            os.makedirs(hb.checkpoint_folder, exist_ok=True)

        for update in range(hb.num_updates):
            for g in self.optimizer.param_groups:
                g["lr"] = ppo.lr * (1 - update / hb.num_updates)
            self.actor_critic.eval()
            for step in range(ppo.num_steps):
                b = rollouts.buffers[rollouts.current_rollout_step_idx]
                with torch.no_grad():
                    act = self.actor_critic.act(b["observations"], b["recurrent_hidden_states"], b["prev_actions"],
                                                b["masks"])
                outs = self.envs.step([x.item() for x in act.env_actions.cpu()])
                obs, rews, dones, infos = [list(x) for x in zip(*outs)]
                r = torch.tensor(rews, dtype=torch.float, device=self.device).unsqueeze(1)
                nd = torch.tensor([[not d] for d in dones], dtype=torch.bool, device=self.device)
                ep_rew += r
                for i, d in enumerate(dones):
                    if d:
                        window["reward"].append(ep_rew[i].item())
                        window["success"].append(float(infos[i]["success"]))
                        window["spl"].append(float(infos[i]["spl"]))
                ep_rew.masked_fill_(~nd, 0.0)
                rollouts.insert(next_observations=batch_obs(obs, device=self.device), rewards=r, next_masks=nd,
                                actions=act.actions, action_log_probs=act.action_log_probs,
                                value_preds=act.values, next_recurrent_hidden_states=act.rnn_hidden_states)
                rollouts.advance_rollout()
                if (step + 1 >= ppo.num_steps * SHORT_ROLLOUT_THRESHOLD and int(self.num_done_store.get("num_done"))
                        >= hb.rl.ddppo.sync_frac * self.world_size):
                    break
            self.num_done_store.add("num_done", 1)
            n_steps = rollouts.current_rollout_step_idx * self.envs.num_envs

            losses = self._update(rollouts)
            keys = ("reward", "success", "spl")
            s = torch.tensor([n_steps, len(window["reward"])] + [sum(window[k]) for k in keys],
                             dtype=torch.float64, device=self.device)
            dist.all_reduce(s)
            if self.world_rank == 0:
                self.num_done_store.set("num_done", "0")
            count_steps += int(s[0].item())

            if self.world_rank == 0 and update % hb.log_interval == 0:
                losses = self._coalesce_and_reduce(losses)
                n = max(s[1].item(), 1.0)
                for i, k in enumerate(keys):
                    writer.add_scalar(f"metrics/{k}", s[2 + i].item() / n, count_steps)
                for k, v in losses.items():
                    writer.add_scalar(f"losses/{k}", v, count_steps)
                logger.info(f"update {update} fps {count_steps / (time.time() - t0):.1f} frames {count_steps} "
                            f"success {s[3].item() / n:.3f} spl {s[4].item() / n:.3f}")
            if self.world_rank == 0 and (update + 1) % hb.checkpoint_interval == 0:
                torch.save({"state_dict": self.actor_critic.state_dict(), "config": cfg,
                            "extra_state": {"step": count_steps, "update": update + 1}},
                           os.path.join(hb.checkpoint_folder, f"ckpt.{(update + 1) // hb.checkpoint_interval}.pth"))

        self.envs.close()
        if writer is not None:
            writer.close()
        dist.destroy_process_group()


def main():
    args = sys.argv[1:]
    name = next((a.split("=", 1)[1] for a in args if a.startswith("--config-name=")), "pointnav/ddppo_pointnav.yaml")
    overrides = [a for a in args if not a.startswith("--config-name=")]
    Trainer(get_config(name, overrides)).train()


if __name__ == "__main__":
    main()
