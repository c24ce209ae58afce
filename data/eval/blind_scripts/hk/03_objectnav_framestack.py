"""Decentralized distributed PPO for ObjectNav (HM3D), frame-stacked feed-forward agent.

No recurrence: the policy sees the last `frame_stack` RGB-D frames, which lets us
shuffle individual transitions into fixed-size minibatches.

Launch:
    torchrun --nproc_per_node=4 objnav_ddppo.py --cfg cfg/objnav_hm3d.yaml
"""
import argparse
import math
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

import habitat
from habitat.config import read_write
from habitat.config.default import get_config
from habitat_baselines.common.environments import get_env_class
from habitat_baselines.utils.common import batch_obs

DEFAULTS = dict(
    habitat_cfg="benchmark/nav/objectnav/objectnav_hm3d.yaml",
    num_envs=6, num_steps=64, frame_stack=4, total_frames=5e8,
    lr=3e-4, ppo_epochs=4, minibatch_size=256, clip=0.2, value_coef=0.5,
    entropy_coef=0.01, gamma=0.99, lam=0.95, max_grad_norm=0.5,
    sync_frac=0.6, short_rollout=0.25, log_every=20, save_every=500,
    out_dir="runs/objnav_ff", seed=7,
)


def make_env(cfg, rank_seed):
    env = get_env_class(cfg.habitat_baselines.env_task)(config=cfg)
    env.seed(rank_seed)
    return env


class FrameStackEncoder(nn.Module):
    def __init__(self, frame_stack, num_goals=6, out_dim=512):
        super().__init__()
        resnet = torchvision.models.resnet18(weights=None)
        resnet.conv1 = nn.Conv2d(4 * frame_stack, 64, 7, stride=2, padding=3, bias=False)
        # swap BN for GN: statistics over tiny per-GPU batches are useless
        self.backbone = nn.Sequential(*[
            nn.GroupNorm(32, m.num_features) if isinstance(m, nn.BatchNorm2d) else m
            for m in list(resnet.children())[:-2]])
        for layer in self.backbone[4:]:
            for block in layer:
                block.bn1 = nn.GroupNorm(32, block.bn1.num_features)
                block.bn2 = nn.GroupNorm(32, block.bn2.num_features)
                if block.downsample is not None:
                    block.downsample[1] = nn.GroupNorm(32, block.downsample[1].num_features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.goal_embed = nn.Embedding(num_goals, 32)
        self.fc = nn.Linear(512 + 32 + 3, out_dim)

    def forward(self, frames, goal, gps_compass):
        x = self.pool(self.backbone(frames)).flatten(1)
        g = torch.cat([gps_compass[:, :2], gps_compass[:, 2:].cos()], -1)
        return F.relu(self.fc(torch.cat([x, self.goal_embed(goal.long().squeeze(-1)), g], -1)))


class ActorCritic(nn.Module):
    def __init__(self, frame_stack, num_actions=6):
        super().__init__()
        self.enc = FrameStackEncoder(frame_stack)
        self.pi = nn.Linear(512, num_actions)
        self.v = nn.Linear(512, 1)

    def forward(self, frames, goal, gps, actions=None):
        h = self.enc(frames, goal, gps)
        dist_ = torch.distributions.Categorical(logits=self.pi(h))
        if actions is None:
            actions = dist_.sample()
        return actions, dist_.log_prob(actions), dist_.entropy(), self.v(h).squeeze(-1)


class FrameBuffer:
    """Keeps the last k RGB-D frames per env, zeroed on episode reset."""

    def __init__(self, n_envs, k, h, w, device):
        self.buf = torch.zeros(n_envs, 4 * k, h, w, device=device)

    def push(self, rgbd, dones=None):
        if dones is not None:
            self.buf[dones] = 0
        self.buf = torch.cat([self.buf[:, 4:], rgbd], 1)
        return self.buf.clone()


def obs_to_rgbd(batch):
    rgb = batch["rgb"].float().permute(0, 3, 1, 2) / 255.0
    depth = batch["depth"].float().permute(0, 3, 1, 2)
    return torch.cat([rgb, depth], 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = OmegaConf.create(DEFAULTS)
    if a.cfg:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(a.cfg))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(a.overrides))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed + rank)

    store = dist.PrefixStore("preempt", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 17, world, rank == 0))
    store.set("done", "0")

    hcfg = get_config(cfg.habitat_cfg)
    with read_write(hcfg):
        hcfg.habitat.simulator.habitat_sim_v0.gpu_device_id = local_rank
    env_args = [(hcfg, cfg.seed + 1000 * rank + i) for i in range(cfg.num_envs)]
    envs = habitat.VectorEnv(make_env_fn=make_env, env_fn_args=env_args,
                             multiprocessing_start_method="forkserver")

    model = ActorCritic(cfg.frame_stack, envs.action_spaces[0].n).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr, eps=1e-5)

    T, N = cfg.num_steps, cfg.num_envs
    first = batch_obs(envs.reset(), device=device)
    H, W = first["depth"].shape[1:3]
    frames = FrameBuffer(N, cfg.frame_stack, H, W, device)
    cur = frames.push(obs_to_rgbd(first))
    goal, gps = first["objectgoal"], torch.cat([first["gps"], first["compass"]], -1)

    buf = dict(frames=torch.zeros(T, N, 4 * cfg.frame_stack, H, W, device=device),
               goal=torch.zeros(T, N, 1, device=device), gps=torch.zeros(T, N, 3, device=device),
               act=torch.zeros(T, N, dtype=torch.long, device=device), logp=torch.zeros(T, N, device=device),
               val=torch.zeros(T + 1, N, device=device), rew=torch.zeros(T, N, device=device),
               done=torch.zeros(T, N, device=device))

    ep_ret = torch.zeros(N, device=device)
    succ_win, spl_win, ret_win = deque(maxlen=100), deque(maxlen=100), deque(maxlen=100)
    frames_total, update, t0 = 0, 0, time.time()
    os.makedirs(cfg.out_dir, exist_ok=True)

    while frames_total < cfg.total_frames:
        model.eval()
        t_used = 0
        for t in range(T):
            with torch.no_grad():
                act, logp, _, val = model(cur, goal, gps)
            buf["frames"][t], buf["goal"][t], buf["gps"][t] = cur, goal, gps
            buf["act"][t], buf["logp"][t], buf["val"][t] = act, logp, val
            outs = envs.step(act.tolist())
            obs, rew, done, info = [list(x) for x in zip(*outs)]
            ob = batch_obs(obs, device=device)
            done_t = torch.tensor(done, device=device)
            rew_t = torch.tensor(rew, dtype=torch.float, device=device)
            buf["rew"][t], buf["done"][t] = rew_t, done_t.float()
            ep_ret += rew_t
            for i in np.nonzero(done)[0]:
                succ_win.append(info[i]["success"])
                spl_win.append(info[i]["spl"])
                ret_win.append(ep_ret[i].item())
            ep_ret[done_t] = 0
            cur = frames.push(obs_to_rgbd(ob), done_t)
            goal, gps = ob["objectgoal"], torch.cat([ob["gps"], ob["compass"]], -1)
            t_used = t + 1
            if t_used >= cfg.short_rollout * T and int(store.get("done")) >= cfg.sync_frac * world:
                break
        store.add("done", 1)

        with torch.no_grad():
            buf["val"][t_used] = model(cur, goal, gps)[3]
        adv = torch.zeros(t_used, N, device=device)
        last = torch.zeros(N, device=device)
        for t in reversed(range(t_used)):
            nonterm = 1.0 - buf["done"][t]
            delta = buf["rew"][t] + cfg.gamma * buf["val"][t + 1] * nonterm - buf["val"][t]
            last = delta + cfg.gamma * cfg.lam * nonterm * last
            adv[t] = last
        ret = adv + buf["val"][:t_used]

        flat = {k: buf[k][:t_used].flatten(0, 1) for k in ("frames", "goal", "gps", "act", "logp")}
        flat_adv, flat_ret = adv.flatten(), ret.flatten()
        flat_adv = (flat_adv - flat_adv.mean()) / (flat_adv.std() + 1e-8)

        model.train()
        n_samples = t_used * N
        n_mb = max(1, n_samples // cfg.minibatch_size)
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(n_samples, device=device)
            for mb in perm[: n_mb * cfg.minibatch_size].view(n_mb, -1):
                _, new_logp, ent, v = ddp(flat["frames"][mb], flat["goal"][mb], flat["gps"][mb], flat["act"][mb])
                ratio = (new_logp - flat["logp"][mb]).exp()
                pg = -torch.min(ratio * flat_adv[mb],
                                ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * flat_adv[mb]).mean()
                vl = F.mse_loss(v, flat_ret[mb])
                loss = pg + cfg.value_coef * vl - cfg.entropy_coef * ent.mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(ddp.parameters(), cfg.max_grad_norm)
                opt.step()

        stats = torch.tensor([float(n_samples), sum(succ_win), sum(spl_win), sum(ret_win), len(succ_win)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        frames_total += int(stats[0].item())
        if rank == 0:
            store.set("done", "0")
        update += 1

        for g in opt.param_groups:
            g["lr"] = cfg.lr * max(0.0, 1.0 - frames_total / cfg.total_frames)

        if rank == 0 and update % cfg.log_every == 0:
            n_ep = max(stats[4].item(), 1.0)
            print(f"[{update:6d}] frames={frames_total:.3e} fps={frames_total / (time.time() - t0):.0f} "
                  f"succ={stats[1] / n_ep:.3f} spl={stats[2] / n_ep:.3f} ret={stats[3] / n_ep:.2f} "
                  f"pg={pg.item():.4f} vl={vl.item():.4f}", flush=True)
        if rank == 0 and update % cfg.save_every == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "frames": frames_total,
                        "cfg": OmegaConf.to_container(cfg)}, os.path.join(cfg.out_dir, f"ckpt_{update:06d}.pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
