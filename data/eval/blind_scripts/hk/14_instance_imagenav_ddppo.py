"""Instance-ImageNav (HM3D) DD-PPO trainer.

The goal image is encoded by the same ResNet as the egocentric RGB; metrics are
averaged over the last `window` episodes of all workers.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        iin_ddppo.py --exp-config configs/instance_imagenav_hm3d.yaml
"""
import argparse
import os
import time
from collections import defaultdict, deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from habitat import logger
from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.config.default import get_config
from habitat_baselines.utils.common import batch_obs

METRICS = ("reward", "success", "spl", "distance_to_goal")


def gn_resnet18():
    return torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(16, c))


class IINPolicy(nn.Module):
    def __init__(self, n_actions, hidden=512):
        super().__init__()
        r = gn_resnet18()
        self.backbone = nn.Sequential(*list(r.children())[:-1], nn.Flatten())
        self.fuse = nn.Sequential(nn.Linear(1024 + 32, hidden), nn.ReLU(True))
        self.prev_a = nn.Embedding(n_actions + 1, 32)
        self.rnn = nn.LSTM(hidden, hidden, num_layers=2)
        self.actor = nn.Linear(hidden, n_actions)
        self.critic = nn.Linear(hidden, 1)

    def _enc(self, img):
        return self.backbone(F.interpolate(img.permute(0, 3, 1, 2).float() / 255.0, size=(224, 224)))

    def features(self, obs, hc, prev_a, masks):
        x = torch.cat([self._enc(obs["rgb"]), self._enc(obs["instance_imagegoal"]),
                       self.prev_a(((prev_a + 1) * masks.long()).squeeze(-1))], -1)
        x = self.fuse(x)
        h, c = hc
        n = h.shape[1]
        x, m = x.view(-1, n, x.shape[-1]), masks.view(-1, n, 1).float()
        outs = []
        for t in range(x.shape[0]):
            o, (h, c) = self.rnn(x[t:t + 1], (h * m[t].unsqueeze(0), c * m[t].unsqueeze(0)))
            outs.append(o[0])
        return torch.stack(outs).flatten(0, 1), (h, c)

    def act(self, obs, hc, prev_a, masks):
        f, hc = self.features(obs, hc, prev_a, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        a = d.sample()
        return self.critic(f).squeeze(-1), a, d.log_prob(a), hc

    def forward(self, obs, hc, prev_a, masks, actions):
        f, _ = self.features(obs, hc, prev_a, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        return self.critic(f).squeeze(-1), d.log_prob(actions), d.entropy().mean()


class Trainer:
    def __init__(self, config):
        self.config = config
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.store = dist.PrefixStore("ddppo", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, self.world, self.rank == 0))
        self.store.set("num_done", "0")
        self.window = defaultdict(lambda: deque(maxlen=config.RL.PPO.reward_window_size))

    def reduce_window(self):
        t = torch.tensor([[sum(self.window[k]), len(self.window[k])] for k in METRICS], dtype=torch.float64)
        dist.all_reduce(t)
        return {k: (t[i, 0] / t[i, 1].clamp(min=1)).item() for i, k in enumerate(METRICS)}

    def train(self):
        cfg, ppo = self.config, self.config.RL.PPO
        cfg.defrost()
        cfg.TORCH_GPU_ID = cfg.SIMULATOR_GPU_ID = self.local_rank
        cfg.TASK_CONFIG.SEED += self.rank * cfg.NUM_ENVIRONMENTS
        cfg.freeze()
        torch.manual_seed(cfg.TASK_CONFIG.SEED)
        envs = construct_envs(cfg, get_env_class(cfg.ENV_NAME))
        dev, N, T = self.device, envs.num_envs, ppo.num_steps
        policy = IINPolicy(envs.action_spaces[0].n, ppo.hidden_size).to(dev)
        ddp = nn.parallel.DistributedDataParallel(policy, device_ids=[self.local_rank])
        optim = torch.optim.Adam(policy.parameters(), lr=ppo.lr, eps=ppo.eps)

        obs_buf = [batch_obs(envs.reset(), device=dev)] + [None] * T
        h = torch.zeros(T + 1, 2, N, ppo.hidden_size, device=dev)
        c = torch.zeros_like(h)
        prev_a = torch.zeros(T + 1, N, 1, dtype=torch.long, device=dev)
        masks = torch.zeros(T + 1, N, 1, dtype=torch.bool, device=dev)
        acts = torch.zeros(T, N, dtype=torch.long, device=dev)
        logps, rews = torch.zeros(T, N, device=dev), torch.zeros(T, N, device=dev)
        vals, rets = torch.zeros(T + 1, N, device=dev), torch.zeros(T, N, device=dev)
        ep_rew = np.zeros(N)
        frames, t0 = 0, time.time()
        if self.rank == 0:
            os.makedirs(cfg.CHECKPOINT_FOLDER, exist_ok=True)

        for update in range(cfg.NUM_UPDATES):
            for g in optim.param_groups:
                g["lr"] = ppo.lr * (1 - update / cfg.NUM_UPDATES)
            L = 0
            for t in range(T):
                with torch.no_grad():
                    v, a, lp, (hn, cn) = policy.act(obs_buf[t], (h[t], c[t]), prev_a[t], masks[t])
                out = envs.step(a.tolist())
                o, r, d, info = [list(x) for x in zip(*out)]
                ep_rew += r
                for i, done in enumerate(d):
                    if done:
                        self.window["reward"].append(ep_rew[i])
                        for k in METRICS[1:]:
                            self.window[k].append(float(info[i][k]))
                        ep_rew[i] = 0.0
                obs_buf[t + 1] = batch_obs(o, device=dev)
                h[t + 1], c[t + 1], prev_a[t + 1] = hn, cn, a.unsqueeze(-1)
                masks[t + 1] = torch.tensor([[not x] for x in d], dtype=torch.bool, device=dev)
                acts[t], logps[t], vals[t] = a, lp, v
                rews[t] = torch.tensor(r, dtype=torch.float, device=dev)
                L = t + 1
                if L >= 0.25 * T and int(self.store.get("num_done")) >= cfg.RL.DDPPO.sync_frac * self.world:
                    break
            self.store.add("num_done", 1)

            with torch.no_grad():
                vals[L] = policy.act(obs_buf[L], (h[L], c[L]), prev_a[L], masks[L])[0]
            gae = torch.zeros(N, device=dev)
            for t in reversed(range(L)):
                m = masks[t + 1].squeeze(-1).float()
                delta = rews[t] + ppo.gamma * vals[t + 1] * m - vals[t]
                gae = delta + ppo.gamma * ppo.tau * m * gae
                rets[t] = gae + vals[t]
            adv = rets[:L] - vals[:L]
            adv = (adv - adv.mean()) / (adv.std() + 1e-5)

            per = N // ppo.num_mini_batch
            for _ in range(ppo.ppo_epoch):
                perm = torch.randperm(N, device=dev)
                for j in range(ppo.num_mini_batch):
                    idx = perm[j * per:(j + 1) * per]
                    ob = {k: torch.stack([obs_buf[t][k][idx] for t in range(L)]).flatten(0, 1) for k in obs_buf[0]}
                    v, lp, ent = ddp(ob, (h[0][:, idx], c[0][:, idx]), prev_a[:L, idx].flatten(0, 1),
                                     masks[:L, idx].flatten(0, 1), acts[:L, idx].flatten())
                    ratio = (lp - logps[:L, idx].flatten()).exp()
                    mb_adv = adv[:, idx].flatten()
                    pg = -torch.min(ratio * mb_adv, ratio.clamp(1 - ppo.clip_param, 1 + ppo.clip_param) * mb_adv).mean()
                    vl = 0.5 * (rets[:L, idx].flatten() - v).pow(2).mean()
                    optim.zero_grad()
                    (pg + ppo.value_loss_coef * vl - ppo.entropy_coef * ent).backward()
                    nn.utils.clip_grad_norm_(policy.parameters(), ppo.max_grad_norm)
                    optim.step()
            obs_buf[0] = obs_buf[L]
            h[0], c[0], prev_a[0], masks[0] = h[L], c[L], prev_a[L], masks[L]

            n_frames = torch.tensor([L * N], dtype=torch.long, device=dev)
            dist.all_reduce(n_frames)
            frames += int(n_frames.item())
            if self.rank == 0:
                self.store.set("num_done", "0")

            if update % cfg.LOG_INTERVAL == 0:
                metrics = self.reduce_window()
                if self.rank == 0:
                    logger.info(f"update {update} frames {frames} fps {frames / (time.time() - t0):.0f} "
                                + " ".join(f"{k}={v:.3f}" for k, v in metrics.items()))
            if self.rank == 0 and (update + 1) % cfg.CHECKPOINT_INTERVAL == 0:
                torch.save({"state_dict": policy.state_dict(), "config": cfg, "frames": frames},
                           os.path.join(cfg.CHECKPOINT_FOLDER, f"ckpt.{(update + 1) // cfg.CHECKPOINT_INTERVAL}.pth"))

        envs.close()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--exp-config", required=True)
    p.add_argument("opts", nargs=argparse.REMAINDER)
    a = p.parse_args()
    Trainer(get_config(a.exp_config, a.opts)).train()


if __name__ == "__main__":
    main()
