"""RL fine-tuning of a VLN-CE seq2seq agent with DD-PPO (R2R-CE, RGB-D + instruction).

Initialised from the DAgger checkpoint, then trained with the ndtw-based reward.

    torchrun --nproc_per_node=8 vlnce_ddppo.py --exp-config vlnce_baselines/config/r2r_ddppo.yaml \
        --init-ckpt data/checkpoints/dagger_best.pth
"""
import argparse
import os
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from habitat import logger
from habitat_baselines.common.baseline_registry import baseline_registry
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.common.obs_transformers import apply_obs_transforms_batch, get_active_obs_transforms
from habitat_baselines.utils.common import batch_obs
from vlnce_baselines.config.default import get_config
from vlnce_baselines.models.seq2seq_policy import Seq2SeqPolicy


class VLNRollouts:
    def __init__(self, T, N, hidden, n_layers, device):
        self.T, self.N = T, N
        self.obs = [None] * (T + 1)
        self.h = torch.zeros(T + 1, N, n_layers, hidden, device=device)
        self.prev_a = torch.zeros(T + 1, N, 1, dtype=torch.long, device=device)
        self.masks = torch.zeros(T + 1, N, 1, dtype=torch.bool, device=device)
        self.a = torch.zeros(T, N, 1, dtype=torch.long, device=device)
        self.logp = torch.zeros(T, N, 1, device=device)
        self.v = torch.zeros(T + 1, N, 1, device=device)
        self.r = torch.zeros(T, N, 1, device=device)
        self.ret = torch.zeros(T + 1, N, 1, device=device)
        self.t = 0

    def insert(self, obs, h, a, logp, v, r, masks):
        t = self.t
        self.obs[t + 1] = obs
        self.h[t + 1], self.a[t], self.prev_a[t + 1] = h, a, a
        self.logp[t], self.v[t], self.r[t], self.masks[t + 1] = logp, v, r, masks
        self.t += 1

    def gae(self, next_v, gamma, lam):
        self.v[self.t] = next_v
        g = torch.zeros_like(next_v)
        for t in reversed(range(self.t)):
            m = self.masks[t + 1].float()
            delta = self.r[t] + gamma * self.v[t + 1] * m - self.v[t]
            g = delta + gamma * lam * m * g
            self.ret[t] = g + self.v[t]

    def batches(self, adv, n_mb):
        per = self.N // n_mb
        perm = torch.randperm(self.N)
        for j in range(n_mb):
            idx = perm[j * per:(j + 1) * per]
            obs = {k: torch.cat([self.obs[t][k][idx] for t in range(self.t)]) for k in self.obs[0]}
            yield (obs, self.h[0, idx], self.prev_a[:self.t, idx].flatten(0, 1), self.masks[:self.t, idx].flatten(0, 1),
                   self.a[:self.t, idx].flatten(0, 1), self.logp[:self.t, idx].flatten(0, 1),
                   self.ret[:self.t, idx].flatten(0, 1), adv[:, idx].flatten(0, 1))

    def after_update(self):
        t = self.t
        self.obs[0] = self.obs[t]
        self.h[0], self.prev_a[0], self.masks[0] = self.h[t], self.prev_a[t], self.masks[t]
        self.t = 0


class EvalActions(nn.Module):
    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, *args):
        return self.policy.evaluate_actions(*args)

    def act(self, *args, **kwargs):
        return self.policy.act(*args, **kwargs)


class VLNDDPPOTrainer:
    def __init__(self, config, init_ckpt):
        self.config = config
        self.init_ckpt = init_ckpt
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.store = dist.PrefixStore("rollout_tracker", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, self.world, self.rank == 0))
        self.store.set("num_done", "0")

    def _setup(self):
        cfg = self.config
        cfg.defrost()
        cfg.TORCH_GPU_ID = self.local_rank
        cfg.SIMULATOR_GPU_IDS = [self.local_rank]
        cfg.TASK_CONFIG.SEED += self.rank * cfg.NUM_ENVIRONMENTS
        cfg.freeze()
        torch.manual_seed(cfg.TASK_CONFIG.SEED)
        self.envs = construct_envs(cfg, get_env_class(cfg.ENV_NAME))
        self.obs_transforms = get_active_obs_transforms(cfg)
        policy = Seq2SeqPolicy(self.envs.observation_spaces[0], self.envs.action_spaces[0], cfg.MODEL)
        if self.init_ckpt:
            sd = torch.load(self.init_ckpt, map_location="cpu")["state_dict"]
            policy.load_state_dict(sd, strict=False)
        policy.to(self.device)
        self.num_layers = policy.net.num_recurrent_layers
        self.actor_critic = DDP(EvalActions(policy), device_ids=[self.local_rank], output_device=self.local_rank)
        self.policy = policy
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.RL.PPO.lr, eps=cfg.RL.PPO.eps)

    def _obs(self, observations):
        return apply_obs_transforms_batch(batch_obs(observations, self.device), self.obs_transforms)

    def train(self):
        self._setup()
        cfg, ppo = self.config, self.config.RL.PPO
        N = self.envs.num_envs
        roll = VLNRollouts(ppo.num_steps, N, cfg.MODEL.STATE_ENCODER.hidden_size, self.num_layers, self.device)
        roll.obs[0] = self._obs(self.envs.reset())
        window = defaultdict(lambda: deque(maxlen=ppo.reward_window_size))
        frames, t0 = 0, time.time()
        if self.rank == 0:
            os.makedirs(cfg.CHECKPOINT_FOLDER, exist_ok=True)

        for update in range(cfg.NUM_UPDATES):
            for g in self.optimizer.param_groups:
                g["lr"] = ppo.lr * (1.0 - update / cfg.NUM_UPDATES)
            for step in range(ppo.num_steps):
                t = roll.t
                with torch.no_grad():
                    v, a, logp, h = self.actor_critic.act(roll.obs[t], roll.h[t], roll.prev_a[t], roll.masks[t])
                outs = self.envs.step([x.item() for x in a.cpu()])
                obs, rews, dones, infos = [list(x) for x in zip(*outs)]
                for i, d in enumerate(dones):
                    if d:
                        for k in ("success", "spl", "ndtw", "path_length"):
                            window[k].append(float(infos[i][k]))
                roll.insert(self._obs(obs), h, a, logp, v,
                            torch.tensor(rews, dtype=torch.float, device=self.device).unsqueeze(1),
                            torch.tensor([[not d] for d in dones], dtype=torch.bool, device=self.device))
                if (step + 1 >= 0.25 * ppo.num_steps
                        and int(self.store.get("num_done")) >= cfg.RL.DDPPO.sync_frac * self.world):
                    break
            self.store.add("num_done", 1)
            steps = roll.t * N

            with torch.no_grad():
                t = roll.t
                next_v = self.policy.get_value(roll.obs[t], roll.h[t], roll.prev_a[t], roll.masks[t])
            roll.gae(next_v, ppo.gamma, ppo.tau)
            adv = roll.ret[:roll.t] - roll.v[:roll.t]
            adv = (adv - adv.mean()) / (adv.std() + 1e-5)
            for _ in range(ppo.ppo_epoch):
                for obs, h0, pa, m, a, old_lp, ret, ad in roll.batches(adv, ppo.num_mini_batch):
                    v, lp, ent, _ = self.actor_critic(obs, h0, pa, m, a)
                    ratio = torch.exp(lp - old_lp)
                    pg = -torch.min(ratio * ad, ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * ad).mean()
                    vl = 0.5 * (ret - v).pow(2).mean()
                    self.optimizer.zero_grad()
                    (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                    nn.utils.clip_grad_norm_(self.policy.parameters(), ppo.max_grad_norm)
                    self.optimizer.step()
            roll.after_update()

            keys = ("success", "spl", "ndtw", "path_length")
            s = torch.tensor([steps, len(window["success"])] + [sum(window[k]) for k in keys],
                             dtype=torch.float, device=self.device)
            dist.all_reduce(s)
            if self.rank == 0:
                self.store.set("num_done", "0")
            frames += int(s[0].item())
            if self.rank == 0 and update % cfg.LOG_INTERVAL == 0:
                n = max(s[1].item(), 1.0)
                logger.info(f"update {update} frames {frames} fps {frames / (time.time() - t0):.0f} "
                            + " ".join(f"{k} {s[2 + i].item() / n:.3f}" for i, k in enumerate(keys)))
            if self.rank == 0 and (update + 1) % cfg.CHECKPOINT_INTERVAL == 0:
                torch.save({"state_dict": self.policy.state_dict(), "config": cfg, "frames": frames},
                           os.path.join(cfg.CHECKPOINT_FOLDER, f"ckpt.{(update + 1) // cfg.CHECKPOINT_INTERVAL}.pth"))

        self.envs.close()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--exp-config", required=True)
    p.add_argument("--init-ckpt", default="")
    p.add_argument("opts", nargs=argparse.REMAINDER)
    a = p.parse_args()
    VLNDDPPOTrainer(get_config(a.exp_config, a.opts), a.init_ckpt).train()


if __name__ == "__main__":
    main()
