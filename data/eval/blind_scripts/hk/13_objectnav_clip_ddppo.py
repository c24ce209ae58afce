"""ObjectNav DD-PPO with a frozen CLIP ResNet-50 visual backbone (HM3D v2).

Rollouts can be cut short by the straggler preemption, so every rank may update on
a different number of steps. Minibatches are split over environments, never over
samples, so all ranks do the same number of backward passes.

    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        objnav_clip_ddppo.py --config cfg/objnav_clip.yaml
"""
import argparse
import contextlib
import dataclasses
import os
import time
from collections import deque

import clip
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

from habitat_baselines.common.env_utils import construct_envs
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.config.default import get_config
from habitat_baselines.utils.common import batch_obs


@dataclasses.dataclass
class PPOCfg:
    exp_config: str = "configs/objectnav_hm3d_clip.yaml"
    ckpt_dir: str = "/checkpoint/objnav_clip"
    num_steps: int = 64
    ppo_epoch: int = 2
    num_mini_batch: int = 2
    grad_accum: int = 2
    lr: float = 2.5e-4
    clip_param: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    gamma: float = 0.99
    tau: float = 0.95
    max_grad_norm: float = 0.2
    hidden: int = 512
    sync_frac: float = 0.6
    short_rollout: float = 0.25
    total_frames: float = 5e8
    log_interval: int = 10
    ckpt_interval: int = 500


class ClipObjectNavPolicy(nn.Module):
    def __init__(self, n_categories, n_actions, hidden):
        super().__init__()
        backbone, _ = clip.load("RN50", device="cpu")
        self.visual = backbone.visual.float().eval()
        for p in self.visual.parameters():
            p.requires_grad_(False)
        self.register_buffer("mean", torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1))
        self.goal_embed = nn.Embedding(n_categories, 32)
        self.gps_fc = nn.Linear(4, 32)
        self.prev_a = nn.Embedding(n_actions + 1, 32)
        self.rnn = nn.GRU(1024 + 96, hidden, num_layers=2)
        self.actor = nn.Linear(hidden, n_actions)
        self.critic = nn.Linear(hidden, 1)

    @torch.no_grad()
    def embed(self, rgb):
        x = (rgb.permute(0, 3, 1, 2).float() / 255.0 - self.mean) / self.std
        return self.visual(x)

    def core(self, vis, goal, gps, compass, prev_a, masks, h):
        x = torch.cat([vis, self.goal_embed(goal.long().squeeze(-1)),
                       self.gps_fc(torch.cat([gps, compass.cos(), compass.sin()], -1)),
                       self.prev_a(((prev_a + 1) * masks.long()).squeeze(-1))], -1)
        n = h.shape[1]
        x, m = x.view(-1, n, x.shape[-1]), masks.view(-1, n, 1).float()
        outs = []
        for t in range(x.shape[0]):
            o, h = self.rnn(x[t:t + 1], h * m[t].unsqueeze(0))
            outs.append(o[0])
        return torch.stack(outs).flatten(0, 1), h

    def forward(self, vis, goal, gps, compass, prev_a, masks, h, actions):
        f, _ = self.core(vis, goal, gps, compass, prev_a, masks, h)
        d = torch.distributions.Categorical(logits=self.actor(f))
        return self.critic(f).squeeze(-1), d.log_prob(actions.flatten()), d.entropy().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = PPOCfg(**(yaml.safe_load(open(a.config)) if a.config else {}))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    # reuse the launcher's store for the straggler counter
    tracker = dist.PrefixStore("rollout_tracker", dist.distributed_c10d._get_default_store())
    if rank == 0:
        tracker.set("num_done", "0")
    dist.barrier()

    hab = get_config(cfg.exp_config)
    hab.defrost()
    hab.TORCH_GPU_ID = hab.SIMULATOR_GPU_ID = local_rank
    hab.TASK_CONFIG.SEED += rank * hab.NUM_ENVIRONMENTS
    hab.freeze()
    torch.manual_seed(hab.TASK_CONFIG.SEED)
    envs = construct_envs(hab, get_env_class(hab.ENV_NAME))
    N, T = envs.num_envs, cfg.num_steps
    n_cat = envs.observation_spaces[0]["objectgoal"].high[0] + 1

    policy = ClipObjectNavPolicy(int(n_cat), envs.action_spaces[0].n, cfg.hidden).to(dev)
    ddp = DDP(policy, device_ids=[local_rank])
    params = [p for p in policy.parameters() if p.requires_grad]
    optim = torch.optim.Adam(params, lr=cfg.lr, eps=1e-5)

    def to_fields(obs_list):
        b = batch_obs(obs_list, device=dev)
        return policy.embed(b["rgb"]), b["objectgoal"], b["gps"], b["compass"]

    B = {"vis": torch.zeros(T + 1, N, 1024, device=dev), "goal": torch.zeros(T + 1, N, 1, device=dev),
         "gps": torch.zeros(T + 1, N, 2, device=dev), "compass": torch.zeros(T + 1, N, 1, device=dev),
         "prev_a": torch.zeros(T + 1, N, 1, dtype=torch.long, device=dev),
         "masks": torch.zeros(T + 1, N, 1, dtype=torch.bool, device=dev),
         "h": torch.zeros(T + 1, 2, N, cfg.hidden, device=dev), "a": torch.zeros(T, N, 1, dtype=torch.long, device=dev),
         "lp": torch.zeros(T, N, device=dev), "v": torch.zeros(T + 1, N, device=dev), "r": torch.zeros(T, N, device=dev)}
    B["vis"][0], B["goal"][0], B["gps"][0], B["compass"][0] = to_fields(envs.reset())
    win, ep_r = deque(maxlen=200), np.zeros(N)
    frames, update, t0 = 0, 0, time.time()
    obs_keys = ("vis", "goal", "gps", "compass")

    while frames < cfg.total_frames:
        for g in optim.param_groups:
            g["lr"] = cfg.lr * max(0.0, 1 - frames / cfg.total_frames)
        L = 0
        for t in range(T):
            with torch.no_grad():
                f, h = policy.core(*(B[k][t] for k in obs_keys), B["prev_a"][t], B["masks"][t], B["h"][t])
                d = torch.distributions.Categorical(logits=policy.actor(f))
                act = d.sample()
                B["a"][t], B["lp"][t], B["v"][t] = act.unsqueeze(-1), d.log_prob(act), policy.critic(f).squeeze(-1)
            obs, rew, done, info = [list(x) for x in zip(*envs.step(act.tolist()))]
            ep_r += rew
            for i in np.flatnonzero(done):
                win.append((ep_r[i], info[i]["success"], info[i]["spl"], info[i]["soft_spl"]))
                ep_r[i] = 0
            fields = to_fields(obs)
            for k, val in zip(obs_keys, fields):
                B[k][t + 1] = val
            B["h"][t + 1], B["prev_a"][t + 1] = h, act.unsqueeze(-1)
            B["masks"][t + 1] = torch.as_tensor(~np.asarray(done), device=dev).unsqueeze(-1)
            B["r"][t] = torch.as_tensor(rew, dtype=torch.float, device=dev)
            L = t + 1
            if L >= cfg.short_rollout * T and int(tracker.get("num_done")) >= cfg.sync_frac * world:
                break
        tracker.add("num_done", 1)

        with torch.no_grad():
            f, _ = policy.core(*(B[k][L] for k in obs_keys), B["prev_a"][L], B["masks"][L], B["h"][L])
            B["v"][L] = policy.critic(f).squeeze(-1)
        adv, gae = torch.zeros(L, N, device=dev), torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            m = B["masks"][t + 1].squeeze(-1).float()
            delta = B["r"][t] + cfg.gamma * B["v"][t + 1] * m - B["v"][t]
            gae = delta + cfg.gamma * cfg.tau * m * gae
            adv[t] = gae
        ret = adv + B["v"][:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)

        per_mb = N // cfg.num_mini_batch
        per_chunk = per_mb // cfg.grad_accum
        for _ in range(cfg.ppo_epoch):
            perm = torch.randperm(N, device=dev)
            for j in range(cfg.num_mini_batch):
                mb = perm[j * per_mb:(j + 1) * per_mb]
                optim.zero_grad(set_to_none=True)
                for c in range(cfg.grad_accum):
                    idx = mb[c * per_chunk:(c + 1) * per_chunk]
                    last = c == cfg.grad_accum - 1
                    with contextlib.nullcontext() if last else ddp.no_sync():
                        v, lp, ent = ddp(*(B[k][:L, idx].flatten(0, 1) for k in obs_keys),
                                         B["prev_a"][:L, idx].flatten(0, 1), B["masks"][:L, idx].flatten(0, 1),
                                         B["h"][0][:, idx], B["a"][:L, idx])
                        ratio = (lp - B["lp"][:L, idx].flatten()).exp()
                        mb_adv = adv[:, idx].flatten()
                        pg = -torch.min(ratio * mb_adv,
                                        ratio.clamp(1 - cfg.clip_param, 1 + cfg.clip_param) * mb_adv).mean()
                        vl = 0.5 * (ret[:, idx].flatten() - v).pow(2).mean()
                        loss = (pg + cfg.value_coef * vl - cfg.entropy_coef * ent) / cfg.grad_accum
                        loss.backward()
                nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                optim.step()
        for k in (*obs_keys, "prev_a", "masks", "h"):
            B[k][0] = B[k][L]

        w = np.asarray(win, dtype=np.float64).reshape(-1, 4)
        s = torch.tensor([L * N, len(w), *w.sum(0)], dtype=torch.float64, device=dev)
        dist.all_reduce(s)
        frames += int(s[0].item())
        update += 1
        if rank == 0:
            tracker.set("num_done", "0")
            if update % cfg.log_interval == 0:
                n = max(s[1].item(), 1)
                print(f"update {update} frames {frames:.3e} fps {frames / (time.time() - t0):.0f} "
                      f"return {s[2] / n:.2f} success {s[3] / n:.3f} spl {s[4] / n:.3f} softspl {s[5] / n:.3f}",
                      flush=True)
            if update % cfg.ckpt_interval == 0:
                os.makedirs(cfg.ckpt_dir, exist_ok=True)
                trainable = {k: v for k, v in policy.state_dict().items() if not k.startswith("visual.")}
                torch.save({"state_dict": trainable, "frames": frames, "update": update,
                            "cfg": dataclasses.asdict(cfg)}, os.path.join(cfg.ckpt_dir, f"ckpt.{update}.pth"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
