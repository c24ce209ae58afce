"""ObjectNav on MP3D with DD-PPO: every rank loads only its slice of the training
scenes (the full MP3D objectnav train set does not fit in RAM 8 times over).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
        objnav_mp3d.py --config configs/tasks/objectnav_mp3d.yaml --out /shared/objnav_mp3d
"""
import argparse
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import habitat
from habitat.config.default import get_config
from habitat.datasets import make_dataset
from habitat_baselines.rl.ddppo.policy.resnet_policy import ResNetEncoder
from habitat_baselines.rl.ddppo.policy import resnet


class ObjNavRLEnv(habitat.RLEnv):
    def __init__(self, config, dataset, category_index):
        super().__init__(config, dataset)
        self.category_index = category_index
        self._prev = None

    def _augment(self, obs):
        obs["goal_idx"] = np.array([self.category_index[self.habitat_env.current_episode.object_category]])
        return obs

    def reset(self):
        obs = super().reset()
        self._prev = self.habitat_env.get_metrics()["distance_to_goal"]
        return self._augment(obs)

    def step(self, *args, **kwargs):
        obs, r, d, info = super().step(*args, **kwargs)
        return self._augment(obs), r, d, info

    def get_reward_range(self):
        return -1.0, 11.0

    def get_reward(self, observations):
        m = self.habitat_env.get_metrics()
        r = -0.001 + (self._prev - m["distance_to_goal"])
        self._prev = m["distance_to_goal"]
        return r + (10.0 if m["success"] else 0.0)

    def get_done(self, observations):
        return self.habitat_env.episode_over

    def get_info(self, observations):
        return self.habitat_env.get_metrics()


def make_env(config, dataset, category_index, seed):
    env = ObjNavRLEnv(config, dataset, category_index)
    env.seed(seed)
    return env


class ObjNavNet(nn.Module):
    def __init__(self, obs_space, n_categories, n_actions, hidden=512):
        super().__init__()
        self.enc = ResNetEncoder(obs_space, baseplanes=32, ngroups=16, make_backbone=resnet.resnet50)
        self.vis_fc = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(self.enc.output_shape)), hidden), nn.ReLU(True))
        self.goal_emb = nn.Embedding(n_categories, 32)
        self.gps = nn.Linear(4, 32)
        self.rnn = nn.GRU(hidden + 64, hidden, num_layers=2)
        self.actor, self.critic = nn.Linear(hidden, n_actions), nn.Linear(hidden, 1)

    def core(self, obs, h, masks):
        x = self.vis_fc(self.enc(obs))
        gc = torch.cat([obs["gps"], obs["compass"].cos(), obs["compass"].sin()], -1)
        x = torch.cat([x, self.goal_emb(obs["goal_idx"].long().squeeze(-1)), F.relu(self.gps(gc))], -1)
        n = h.shape[1]
        x, m = x.view(-1, n, x.shape[-1]), masks.view(-1, n, 1)
        out = []
        for t in range(x.shape[0]):
            o, h = self.rnn(x[t:t + 1], h * m[t].unsqueeze(0))
            out.append(o[0])
        return torch.stack(out).flatten(0, 1), h

    def forward(self, obs, h, masks, actions=None):
        f, h = self.core(obs, h, masks)
        d = torch.distributions.Categorical(logits=self.actor(f))
        if actions is None:
            actions = d.sample()
        return actions, d.log_prob(actions), d.entropy().mean(), self.critic(f).squeeze(-1), h


def to_batch(obs_list, device):
    return {k: torch.as_tensor(np.stack([o[k] for o in obs_list]), device=device).float()
            for k in ("rgb", "depth", "gps", "compass", "goal_idx")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tasks/objectnav_mp3d.yaml")
    ap.add_argument("--out", default="runs/objnav_mp3d")
    ap.add_argument("--num-envs", type=int, default=4)
    ap.add_argument("--num-steps", type=int, default=64)
    ap.add_argument("--updates", type=int, default=50000)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--ppo-epoch", type=int, default=4)
    ap.add_argument("--num-mini-batch", type=int, default=2)
    ap.add_argument("--sync-frac", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    store = dist.PrefixStore("ddppo", dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                                                    world, rank == 0))
    store.set("num_done", "0")

    cfg = get_config(args.config)
    all_scenes = sorted(make_dataset(cfg.DATASET.TYPE).get_scenes_to_load(cfg.DATASET))
    cfg.defrost()
    cfg.DATASET.CONTENT_SCENES = all_scenes[rank::world]
    cfg.SIMULATOR.HABITAT_SIM_V0.GPU_DEVICE_ID = local_rank
    cfg.freeze()
    dataset = make_dataset(cfg.DATASET.TYPE, config=cfg.DATASET)
    categories = sorted({ep.object_category for ep in dataset.episodes})
    category_index = {c: i for i, c in enumerate(categories)}
    splits = dataset.get_splits(args.num_envs, allow_uneven_splits=True)
    envs = habitat.VectorEnv(make_env_fn=make_env, env_fn_args=[
        (cfg, splits[i], category_index, args.seed + rank * args.num_envs + i) for i in range(args.num_envs)])

    net = ObjNavNet(envs.observation_spaces[0], len(categories), envs.action_spaces[0].n).to(dev)
    ddp = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, eps=1e-5)

    N, T = args.num_envs, args.num_steps
    obs = [to_batch(envs.reset(), dev)] + [None] * T
    hid = torch.zeros(T + 1, 2, N, 512, device=dev)
    masks = torch.zeros(T + 1, N, device=dev)
    act = torch.zeros(T, N, dtype=torch.long, device=dev)
    logp, rew, val = torch.zeros(T, N, device=dev), torch.zeros(T, N, device=dev), torch.zeros(T + 1, N, device=dev)
    win, ep_r = deque(maxlen=100), np.zeros(N)
    frames, t0 = 0, time.time()
    os.makedirs(args.out, exist_ok=True)

    for update in range(args.updates):
        for g in opt.param_groups:
            g["lr"] = args.lr * (1 - update / args.updates)
        L = 0
        for t in range(T):
            with torch.no_grad():
                a, lp, _, v, h = net(obs[t], hid[t], masks[t])
            o, r, d, info = [list(x) for x in zip(*envs.step(a.tolist()))]
            ep_r += r
            for i in np.flatnonzero(d):
                win.append((ep_r[i], info[i]["success"], info[i]["spl"]))
                ep_r[i] = 0
            obs[t + 1] = to_batch(o, dev)
            masks[t + 1] = torch.as_tensor(1.0 - np.asarray(d, dtype=np.float32), device=dev)
            rew[t] = torch.as_tensor(r, dtype=torch.float, device=dev)
            hid[t + 1], act[t], logp[t], val[t] = h, a, lp, v
            L = t + 1
            if L >= T // 4 and int(store.get("num_done")) >= args.sync_frac * world:
                break
        store.add("num_done", 1)

        with torch.no_grad():
            val[L] = net(obs[L], hid[L], masks[L])[3]
        adv, gae = torch.zeros(L, N, device=dev), torch.zeros(N, device=dev)
        for t in reversed(range(L)):
            delta = rew[t] + 0.99 * val[t + 1] * masks[t + 1] - val[t]
            gae = delta + 0.99 * 0.95 * masks[t + 1] * gae
            adv[t] = gae
        ret = adv + val[:L]
        adv = (adv - adv.mean()) / (adv.std() + 1e-5)
        per = N // args.num_mini_batch
        for _ in range(args.ppo_epoch):
            perm = torch.randperm(N, device=dev)
            for j in range(args.num_mini_batch):
                idx = perm[j * per:(j + 1) * per]
                mb_obs = {k: torch.stack([obs[t][k][idx] for t in range(L)]).flatten(0, 1) for k in obs[0]}
                _, nlp, ent, nv, _ = ddp(mb_obs, hid[0][:, idx], masks[:L, idx].flatten(), act[:L, idx].flatten())
                ratio = (nlp - logp[:L, idx].flatten()).exp()
                mb_adv = adv[:, idx].flatten()
                pg = -torch.min(ratio * mb_adv, ratio.clamp(0.8, 1.2) * mb_adv).mean()
                vl = 0.5 * (ret[:, idx].flatten() - nv).pow(2).mean()
                opt.zero_grad()
                (pg + 0.5 * vl - 0.01 * ent).backward()
                nn.utils.clip_grad_norm_(net.parameters(), 0.2)
                opt.step()
        obs[0], hid[0], masks[0] = obs[L], hid[L], masks[L]

        w = np.asarray(win, dtype=np.float64).reshape(-1, 3)
        s = torch.tensor([L * N, len(w), *w.sum(0)], dtype=torch.float64, device=dev)
        dist.all_reduce(s)
        frames += int(s[0].item())
        if rank == 0:
            store.set("num_done", "0")
            if update % 10 == 0:
                n = max(s[1].item(), 1)
                print(f"update {update} frames {frames} fps {frames / (time.time() - t0):.0f} "
                      f"return {s[2] / n:.2f} success {s[3] / n:.3f} spl {s[4] / n:.3f}", flush=True)
            if (update + 1) % 500 == 0:
                torch.save({"net": net.state_dict(), "categories": categories, "update": update + 1},
                           os.path.join(args.out, f"ckpt_{update + 1:06d}.pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
