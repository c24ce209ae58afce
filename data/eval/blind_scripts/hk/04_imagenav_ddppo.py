"""ImageNav with DD-PPO (Gibson, RGB only, shared ResNet encoder for obs and goal).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER:29400 imagenav_ddppo.py --run-dir /checkpoint/$USER/imagenav
"""
import argparse
import dataclasses
import glob
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import habitat
from habitat_baselines.common.environments import NavRLEnv
from habitat_baselines.config.default import get_config
from habitat_baselines.rl.ddppo.policy import resnet
from habitat_baselines.rl.ddppo.policy.resnet_policy import ResNetEncoder
from habitat_baselines.rl.models.rnn_state_encoder import build_rnn_state_encoder
from habitat_baselines.utils.common import batch_obs


@dataclasses.dataclass
class TrainConfig:
    exp_config: str = "configs/imagenav_gibson.yaml"
    run_dir: str = "runs/imagenav"
    num_envs: int = 8
    num_steps: int = 64
    total_steps: float = 5e8
    lr: float = 2.5e-4
    ppo_epoch: int = 2
    num_mini_batch: int = 2
    clip_param: float = 0.2
    value_loss_coef: float = 0.5
    entropy_coef: float = 0.01
    gamma: float = 0.99
    tau: float = 0.95
    max_grad_norm: float = 0.2
    hidden_size: int = 512
    sync_frac: float = 0.6
    checkpoint_interval: int = 200
    log_interval: int = 10
    seed: int = 1


def parse() -> TrainConfig:
    p = argparse.ArgumentParser()
    for f in dataclasses.fields(TrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=f.type, default=f.default)
    return TrainConfig(**vars(p.parse_args()))


def make_env(config, seed):
    env = NavRLEnv(config=config)
    env.seed(seed)
    return env


class ImageNavNet(nn.Module):
    def __init__(self, obs_space, num_actions, hidden_size):
        super().__init__()
        self.encoder = ResNetEncoder(obs_space, baseplanes=32, ngroups=16,
                                     make_backbone=getattr(resnet, "resnet18"))
        flat = int(np.prod(self.encoder.output_shape))
        self.visual_fc = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden_size), nn.ReLU(True))
        self.goal_fc = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden_size), nn.ReLU(True))
        self.prev_action_embedding = nn.Embedding(num_actions + 1, 32)
        self.state_encoder = build_rnn_state_encoder(2 * hidden_size + 32, hidden_size, rnn_type="GRU")
        self.actor = nn.Linear(hidden_size, num_actions)
        self.critic = nn.Linear(hidden_size, 1)

    def _step(self, obs, hidden, prev_actions, masks):
        x = self.visual_fc(self.encoder({"rgb": obs["rgb"]}))
        g = self.goal_fc(self.encoder({"rgb": obs["imagegoal"]}))
        pa = self.prev_action_embedding(((prev_actions.float() + 1) * masks).long().squeeze(-1))
        return self.state_encoder(torch.cat([x, g, pa], 1), hidden, masks)

    def act(self, obs, hidden, prev_actions, masks):
        feats, hidden = self._step(obs, hidden, prev_actions, masks)
        d = torch.distributions.Categorical(logits=self.actor(feats))
        action = d.sample()
        return self.critic(feats), action.unsqueeze(1), d.log_prob(action).unsqueeze(1), hidden

    def forward(self, obs, hidden, prev_actions, masks, actions):
        feats, _ = self._step(obs, hidden, prev_actions, masks)
        d = torch.distributions.Categorical(logits=self.actor(feats))
        return self.critic(feats), d.log_prob(actions.squeeze(1)).unsqueeze(1), d.entropy().mean()


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.store = dist.PrefixStore("rollout_tracker", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, self.world, self.rank == 0))
        self.store.set("num_done", "0")

        hab = get_config(cfg.exp_config)
        hab.defrost()
        hab.TASK_CONFIG.SEED = cfg.seed + self.rank * cfg.num_envs
        hab.TASK_CONFIG.SIMULATOR.HABITAT_SIM_V0.GPU_DEVICE_ID = self.local_rank
        hab.freeze()
        self.envs = habitat.VectorEnv(
            make_env_fn=make_env,
            env_fn_args=[(hab, hab.TASK_CONFIG.SEED + i) for i in range(cfg.num_envs)],
            multiprocessing_start_method="forkserver")

        self.net = ImageNavNet(self.envs.observation_spaces[0], self.envs.action_spaces[0].n,
                               cfg.hidden_size).to(self.device)
        self.ddp = DistributedDataParallel(self.net, device_ids=[self.local_rank])
        self.optim = torch.optim.Adam(self.net.parameters(), lr=cfg.lr, eps=1e-5)
        self.count_steps, self.num_updates_done, self.ckpt_id = 0, 0, 0
        os.makedirs(os.path.join(cfg.run_dir, "checkpoints"), exist_ok=True)
        self._maybe_resume()

    def _maybe_resume(self):
        ckpts = sorted(glob.glob(os.path.join(self.cfg.run_dir, "checkpoints", "ckpt.*.pth")),
                       key=lambda p: int(p.split(".")[-2]))
        if not ckpts:
            return
        state = torch.load(ckpts[-1], map_location="cpu")
        self.net.load_state_dict(state["state_dict"])
        self.optim.load_state_dict(state["optim_state"])
        self.count_steps, self.num_updates_done = state["count_steps"], state["num_updates_done"]
        self.ckpt_id = state["ckpt_id"] + 1

    def save_checkpoint(self):
        path = os.path.join(self.cfg.run_dir, "checkpoints", f"ckpt.{self.ckpt_id}.pth")
        torch.save({"state_dict": self.net.state_dict(), "optim_state": self.optim.state_dict(),
                    "count_steps": self.count_steps, "num_updates_done": self.num_updates_done,
                    "ckpt_id": self.ckpt_id, "config": dataclasses.asdict(self.cfg)}, path)
        self.ckpt_id += 1

    def train(self):
        c, dev, N, T = self.cfg, self.device, self.cfg.num_envs, self.cfg.num_steps
        obs = batch_obs(self.envs.reset(), device=dev)
        store = {k: torch.zeros(T + 1, *v.shape, dtype=v.dtype, device=dev) for k, v in obs.items()}
        for k in obs:
            store[k][0] = obs[k]
        hid = torch.zeros(T + 1, 1, N, c.hidden_size, device=dev)
        masks = torch.zeros(T + 1, N, 1, dtype=torch.bool, device=dev)
        prev_act = torch.zeros(T + 1, N, 1, dtype=torch.long, device=dev)
        acts = torch.zeros(T, N, 1, dtype=torch.long, device=dev)
        logps, rews = torch.zeros(T, N, 1, device=dev), torch.zeros(T, N, 1, device=dev)
        vals, rets = torch.zeros(T + 1, N, 1, device=dev), torch.zeros(T + 1, N, 1, device=dev)
        ep_ret = torch.zeros(N, 1, device=dev)
        win = {k: deque(maxlen=50) for k in ("reward", "success", "spl")}
        t_start = time.time()

        while self.count_steps < c.total_steps:
            frac = 1.0 - self.count_steps / c.total_steps
            for g in self.optim.param_groups:
                g["lr"] = c.lr * frac
            L = 0
            for t in range(T):
                with torch.no_grad():
                    v, a, lp, h = self.net.act({k: s[t] for k, s in store.items()}, hid[t], prev_act[t],
                                               masks[t])
                outs = self.envs.step(a.squeeze(1).tolist())
                o, r, d, info = [list(x) for x in zip(*outs)]
                nb = batch_obs(o, device=dev)
                for k in nb:
                    store[k][t + 1] = nb[k]
                r = torch.tensor(r, dtype=torch.float, device=dev).unsqueeze(1)
                notdone = torch.tensor([[not x] for x in d], dtype=torch.bool, device=dev)
                hid[t + 1], acts[t], prev_act[t + 1], logps[t], vals[t], rews[t] = h, a, a, lp, v, r
                masks[t + 1] = notdone
                ep_ret += r
                for i, done in enumerate(d):
                    if done:
                        win["reward"].append(ep_ret[i].item())
                        win["success"].append(info[i]["success"])
                        win["spl"].append(info[i]["spl"])
                ep_ret *= notdone.float()
                L = t + 1
                if L >= 0.25 * T and int(self.store.get("num_done")) >= c.sync_frac * self.world:
                    break
            self.store.add("num_done", 1)

            with torch.no_grad():
                vals[L] = self.net.act({k: s[L] for k, s in store.items()}, hid[L], prev_act[L], masks[L])[0]
            gae = torch.zeros(N, 1, device=dev)
            for t in reversed(range(L)):
                m = masks[t + 1].float()
                delta = rews[t] + c.gamma * vals[t + 1] * m - vals[t]
                gae = delta + c.gamma * c.tau * m * gae
                rets[t] = gae + vals[t]
            adv = rets[:L] - vals[:L]
            adv = (adv - adv.mean()) / (adv.std() + 1e-5)

            per = N // c.num_mini_batch
            for _ in range(c.ppo_epoch):
                perm = torch.randperm(N)
                for j in range(c.num_mini_batch):
                    idx = perm[j * per:(j + 1) * per]
                    ob = {k: s[:L, idx].flatten(0, 1) for k, s in store.items()}
                    value, new_lp, ent = self.ddp(ob, hid[0, :, idx], prev_act[:L, idx].flatten(0, 1),
                                                  masks[:L, idx].flatten(0, 1), acts[:L, idx].flatten(0, 1))
                    ratio = torch.exp(new_lp - logps[:L, idx].flatten(0, 1))
                    a_mb = adv[:, idx].flatten(0, 1)
                    pg_loss = -torch.min(ratio * a_mb, ratio.clamp(1 - c.clip_param, 1 + c.clip_param) * a_mb).mean()
                    v_loss = 0.5 * (rets[:L, idx].flatten(0, 1) - value).pow(2).mean()
                    self.optim.zero_grad()
                    (pg_loss + c.value_loss_coef * v_loss - c.entropy_coef * ent).backward()
                    nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm)
                    self.optim.step()

            for k in store:
                store[k][0] = store[k][L]
            hid[0], masks[0], prev_act[0] = hid[L], masks[L], prev_act[L]

            summary = torch.tensor([L * N, sum(win["reward"]), sum(win["success"]), sum(win["spl"]),
                                    len(win["reward"])], dtype=torch.float, device=dev)
            dist.all_reduce(summary)
            if self.rank == 0:
                self.store.set("num_done", "0")
            self.count_steps += int(summary[0].item())
            self.num_updates_done += 1

            if self.rank == 0 and self.num_updates_done % c.log_interval == 0:
                n = max(summary[4].item(), 1)
                print(f"update {self.num_updates_done} frames {self.count_steps} "
                      f"fps {self.count_steps / (time.time() - t_start):.0f} reward {summary[1] / n:.3f} "
                      f"success {summary[2] / n:.3f} spl {summary[3] / n:.3f}", flush=True)
            if self.num_updates_done % c.checkpoint_interval == 0:
                self.save_checkpoint()

        self.envs.close()
        dist.destroy_process_group()


def main():
    Trainer(parse()).train()


if __name__ == "__main__":
    main()
