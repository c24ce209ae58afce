"""Pick skill for Habitat 2.0 rearrangement, DD-PPO with a Gaussian arm policy.

    torchrun --nproc_per_node=8 train_pick.py --out runs/pick_v3 --num-envs 16
"""
import argparse
import json
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

import habitat
from habitat.config import read_write
from habitat.config.default import get_config
from habitat.gym import make_gym_from_config

STATE_KEYS = ("joint", "ee_pos", "obj_start_sensor", "is_holding", "relative_resting_position")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--task-cfg", default="benchmark/rearrange/pick.yaml")
    p.add_argument("--out", default="runs/pick")
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--rollout", type=int, default=128)
    p.add_argument("--updates", type=int, default=20000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--ent-coef", type=float, default=1e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--sync-frac", type=float, default=0.6)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_env(cfg, seed):
    env = make_gym_from_config(cfg)
    env.seed(seed)
    return env


class PickPolicy(nn.Module):
    def __init__(self, state_dim, act_dim, hidden=512):
        super().__init__()
        self.depth = nn.Sequential(
            nn.Conv2d(1, 32, 8, 4), nn.ReLU(True), nn.Conv2d(32, 64, 4, 2), nn.ReLU(True),
            nn.Conv2d(64, 32, 3, 1), nn.ReLU(True), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            nn.Linear(32 * 16, 256), nn.ReLU(True))
        self.trunk = nn.Sequential(nn.Linear(256 + state_dim, hidden), nn.ReLU(True),
                                   nn.Linear(hidden, hidden), nn.ReLU(True))
        self.mu = nn.Linear(hidden, act_dim)
        self.log_std = nn.Parameter(torch.full((act_dim,), -0.5))
        self.v = nn.Linear(hidden, 1)

    def forward(self, depth, state, actions=None):
        h = self.trunk(torch.cat([self.depth(depth.permute(0, 3, 1, 2)), state], -1))
        d = torch.distributions.Normal(torch.tanh(self.mu(h)), self.log_std.clamp(-5, 1).exp())
        if actions is None:
            actions = d.sample()
        return actions, d.log_prob(actions).sum(-1), d.entropy().sum(-1), self.v(h).squeeze(-1)


def flatten_obs(obs_list, device):
    depth = torch.as_tensor(np.stack([o["robot_head_depth"] for o in obs_list]), dtype=torch.float, device=device)
    state = torch.as_tensor(np.stack([np.concatenate([np.asarray(o[k], dtype=np.float32).ravel()
                                                      for k in STATE_KEYS]) for o in obs_list]), device=device)
    return depth, state


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    cfg = get_config(args.task_cfg)
    with read_write(cfg):
        cfg.habitat.simulator.habitat_sim_v0.gpu_device_id = local_rank
        cfg.habitat.seed = args.seed + rank * args.num_envs
    envs = habitat.VectorEnv(make_env_fn=make_env,
                             env_fn_args=[(cfg, cfg.habitat.seed + i) for i in range(args.num_envs)])
    obs = envs.reset()
    depth, state = flatten_obs(obs, dev)
    act_dim = envs.action_spaces[0].shape[0]

    pi = PickPolicy(state.shape[1], act_dim).to(dev)
    ddp_pi = DDP(pi, device_ids=[local_rank])
    opt = torch.optim.Adam(pi.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1 - u / args.updates)

    store = dist.PrefixStore("ddppo", dist.TCPStore(os.environ["MASTER_ADDR"],
                                                    int(os.environ["MASTER_PORT"]) + 1, world, rank == 0))
    store.set("num_done", "0")

    T, N = args.rollout, args.num_envs
    buf_depth = torch.zeros(T + 1, *depth.shape, device=dev)
    buf_state = torch.zeros(T + 1, *state.shape, device=dev)
    buf_act = torch.zeros(T, N, act_dim, device=dev)
    buf_logp, buf_rew = torch.zeros(T, N, device=dev), torch.zeros(T, N, device=dev)
    buf_val, buf_mask = torch.zeros(T + 1, N, device=dev), torch.ones(T + 1, N, device=dev)
    buf_depth[0], buf_state[0] = depth, state

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        json.dump(vars(args), open(os.path.join(args.out, "args.json"), "w"), indent=2)
    ep_ret = np.zeros(N)
    succ_win, ret_win = deque(maxlen=200), deque(maxlen=200)
    total_frames, best_success, t0 = 0, -1.0, time.time()

    for update in range(args.updates):
        L = 0
        for t in range(T):
            with torch.no_grad():
                a, lp, _, v = pi(buf_depth[t], buf_state[t])
            outs = envs.step([{"action": "arm_action", "action_args": {"arm_action": x}}
                              for x in a.cpu().numpy()])
            obs, rew, done, info = [list(x) for x in zip(*outs)]
            ep_ret += np.asarray(rew)
            for i, d in enumerate(done):
                if d:
                    succ_win.append(float(info[i]["pick_success"]))
                    ret_win.append(ep_ret[i])
                    ep_ret[i] = 0.0
            buf_depth[t + 1], buf_state[t + 1] = flatten_obs(obs, dev)
            buf_act[t], buf_logp[t], buf_val[t] = a, lp, v
            buf_rew[t] = torch.as_tensor(rew, dtype=torch.float, device=dev)
            buf_mask[t + 1] = torch.as_tensor([0.0 if d else 1.0 for d in done], device=dev)
            L = t + 1
            if L >= T // 4 and int(store.get("num_done")) >= args.sync_frac * world:
                break
        store.add("num_done", 1)

        with torch.no_grad():
            buf_val[L] = pi(buf_depth[L], buf_state[L])[3]
        adv = torch.zeros(L, N, device=dev)
        gae = torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            delta = buf_rew[t] + args.gamma * buf_val[t + 1] * buf_mask[t + 1] - buf_val[t]
            gae = delta + args.gamma * args.lam * buf_mask[t + 1] * gae
            adv[t] = gae
        ret = adv + buf_val[:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)

        per = N // args.mini_batches
        pg_sum = vl_sum = 0.0
        for _ in range(args.epochs):
            perm = torch.randperm(N, device=dev)
            for j in range(args.mini_batches):
                idx = perm[j * per:(j + 1) * per]
                _, nlp, ent, nv = ddp_pi(buf_depth[:L, idx].flatten(0, 1), buf_state[:L, idx].flatten(0, 1),
                                         buf_act[:L, idx].flatten(0, 1))
                ratio = (nlp - buf_logp[:L, idx].flatten()).exp()
                mb_adv = adv[:, idx].flatten()
                pg = -torch.min(ratio * mb_adv, ratio.clamp(1 - args.clip, 1 + args.clip) * mb_adv).mean()
                vl = (ret[:, idx].flatten() - nv).pow(2).mean()
                opt.zero_grad()
                (pg + args.vf_coef * vl - args.ent_coef * ent.mean()).backward()
                nn.utils.clip_grad_norm_(pi.parameters(), 0.5)
                opt.step()
                pg_sum, vl_sum = pg_sum + pg.item(), vl_sum + vl.item()
        sched.step()
        buf_depth[0], buf_state[0], buf_mask[0] = buf_depth[L], buf_state[L], buf_mask[L]

        frames = torch.tensor([L * N], dtype=torch.long, device=dev)
        dist.all_reduce(frames)
        total_frames += int(frames.item())
        if rank == 0:
            store.set("num_done", "0")

        if rank == 0 and update % args.log_every == 0:
            success = float(np.mean(succ_win)) if succ_win else 0.0
            n_mb = args.epochs * args.mini_batches
            writer.add_scalar("train/success", success, total_frames)
            writer.add_scalar("train/return", float(np.mean(ret_win)) if ret_win else 0.0, total_frames)
            writer.add_scalar("loss/policy", pg_sum / n_mb, total_frames)
            writer.add_scalar("loss/value", vl_sum / n_mb, total_frames)
            writer.add_scalar("perf/fps", total_frames / (time.time() - t0), total_frames)
            print(f"update {update} frames {total_frames} success {success:.3f}", flush=True)
            if success > best_success and len(succ_win) == succ_win.maxlen:
                best_success = success
                torch.save({"policy": pi.state_dict(), "frames": total_frames, "success": success},
                           os.path.join(args.out, "best.pt"))
        if rank == 0 and update % args.save_every == 0:
            torch.save({"policy": pi.state_dict(), "opt": opt.state_dict(), "update": update,
                        "frames": total_frames}, os.path.join(args.out, f"ckpt_{update:06d}.pt"))

    if writer is not None:
        writer.close()
    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
