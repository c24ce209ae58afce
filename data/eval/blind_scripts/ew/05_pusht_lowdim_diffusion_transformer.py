"""Low-dim Diffusion Policy with a transformer denoiser (DP-T) on PushT keypoints.

Replay buffer: pusht_cchi_v7_replay.zarr (data/state, data/action, meta/episode_ends); the observation is
the 5-d state (agent xy, block xy, block angle), the same as gym_pusht's obs_type="state".
Each GPU gets its own set of whole demonstrations, so windows of one episode stay on one GPU.

    torchrun --standalone --nproc_per_node=4 05_pusht_lowdim_diffusion_transformer.py --zarr data/pusht/pusht_cchi_v7_replay.zarr
"""
import argparse
import datetime
import math
import os

import gymnasium as gym
import gym_pusht  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from diffusers import DDIMScheduler, DDPMScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def get_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--out_dir", default="outputs/pusht_dpt")
    ap.add_argument("--obs_horizon", type=int, default=2)
    ap.add_argument("--pred_horizon", type=int, default=16)
    ap.add_argument("--action_horizon", type=int, default=8)
    ap.add_argument("--n_layer", type=int, default=8)
    ap.add_argument("--n_emb", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=100)
    ap.add_argument("--n_eval", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class WindowDataset(Dataset):
    def __init__(self, obs, action, episode_ends, episodes, obs_horizon, pred_horizon, stats):
        self.obs = ((obs - stats["obs_min"]) / (stats["obs_max"] - stats["obs_min"] + 1e-8) * 2 - 1).astype(np.float32)
        self.action = ((action - stats["act_min"]) / (stats["act_max"] - stats["act_min"] + 1e-8) * 2 - 1).astype(np.float32)
        self.obs_horizon, self.pred_horizon = obs_horizon, pred_horizon
        starts = np.concatenate([[0], episode_ends[:-1]])
        self.items = []
        for e in episodes:
            s, t = int(starts[e]), int(episode_ends[e])
            # every step of the episode can start a window; pad with edge values
            for i in range(s - (obs_horizon - 1), t - 1):
                self.items.append((s, t, i))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        s, t, i = self.items[k]
        idx = np.clip(np.arange(i, i + self.pred_horizon), s, t - 1)
        return torch.from_numpy(self.obs[idx[: self.obs_horizon]]), torch.from_numpy(self.action[idx])


class TransformerDenoiser(nn.Module):
    def __init__(self, action_dim, obs_dim, pred_horizon, obs_horizon, n_emb=256, n_layer=8, n_head=4, p_drop=0.1):
        super().__init__()
        self.action_emb = nn.Linear(action_dim, n_emb)
        self.obs_emb = nn.Linear(obs_dim, n_emb)
        self.pos_emb = nn.Parameter(torch.zeros(1, pred_horizon, n_emb))
        self.cond_pos_emb = nn.Parameter(torch.zeros(1, 1 + obs_horizon, n_emb))
        self.n_emb = n_emb
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(n_emb, n_head, 4 * n_emb, p_drop, activation="gelu", batch_first=True, norm_first=True),
            num_layers=2,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(n_emb, n_head, 4 * n_emb, p_drop, activation="gelu", batch_first=True, norm_first=True),
            num_layers=n_layer,
        )
        self.ln_f = nn.LayerNorm(n_emb)
        self.head = nn.Linear(n_emb, action_dim)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(pred_horizon), persistent=False)

    def time_emb(self, t):
        half = self.n_emb // 2
        freq = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / (half - 1))
        arg = t.float()[:, None] * freq[None]
        return torch.cat([arg.sin(), arg.cos()], -1)

    def forward(self, noisy_action, t, obs):
        cond = torch.cat([self.time_emb(t).unsqueeze(1), self.obs_emb(obs)], 1) + self.cond_pos_emb
        memory = self.encoder(cond)
        x = self.action_emb(noisy_action) + self.pos_emb
        x = self.decoder(x, memory, tgt_mask=self.causal_mask)
        return self.head(self.ln_f(x))


@torch.no_grad()
def rollout(model, stats, cfg, device, seed):
    env = gym.make("gym_pusht/PushT-v0", obs_type="state", max_episode_steps=300)
    sched = DDIMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True)
    sched.set_timesteps(16)
    to_t = lambda a: torch.as_tensor(a, dtype=torch.float32, device=device)
    o_min, o_max, a_min, a_max = (to_t(stats[k]) for k in ("obs_min", "obs_max", "act_min", "act_max"))
    model.eval()
    scores = []
    for ep in range(cfg.n_eval):
        obs, _ = env.reset(seed=seed + ep)
        hist = [obs] * cfg.obs_horizon
        best, done = 0.0, False
        while not done:
            o = (to_t(np.stack(hist[-cfg.obs_horizon:])) - o_min) / (o_max - o_min + 1e-8) * 2 - 1
            a = torch.randn(1, cfg.pred_horizon, a_min.shape[0], device=device)
            for t in sched.timesteps:
                a = sched.step(model(a, t.expand(1).to(device), o[None]), t, a).prev_sample
            a = (a[0] + 1) / 2 * (a_max - a_min) + a_min
            for act in a[cfg.obs_horizon - 1: cfg.obs_horizon - 1 + cfg.action_horizon].cpu().numpy():
                obs, r, term, trunc, _ = env.step(act)
                hist.append(obs)
                best = max(best, r)
                done = term or trunc
                if done:
                    break
        scores.append(best)
    model.train()
    env.close()
    return float(np.mean(scores))


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)

    root = zarr.open(cfg.zarr, "r")
    obs = root["data/state"][:]
    action = root["data/action"][:]
    episode_ends = root["meta/episode_ends"][:]
    stats = {"obs_min": obs.min(0), "obs_max": obs.max(0), "act_min": action.min(0), "act_max": action.max(0)}

    episodes = np.random.default_rng(cfg.seed).permutation(len(episode_ends))
    my_episodes = episodes[rank::world_size]
    dataset = WindowDataset(obs, action, episode_ends, my_episodes, cfg.obs_horizon, cfg.pred_horizon, stats)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, num_workers=4, drop_last=True,
                        pin_memory=True, persistent_workers=True)

    model = TransformerDenoiser(action.shape[1], obs.shape[1], cfg.pred_horizon, cfg.obs_horizon,
                                cfg.n_emb, cfg.n_layer).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    noise_sched = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True)
    # effective batch = batch_size * world_size; lr scaled accordingly
    optim = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr * world_size, betas=(0.9, 0.95), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=cfg.lr * world_size, total_steps=cfg.epochs * len(loader),
                                                pct_start=0.01)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        np.savez(os.path.join(cfg.out_dir, "stats.npz"), **stats)

    for epoch in range(cfg.epochs):
        ddp.train()
        running = torch.zeros(2, device=device)
        for o, a in loader:
            o, a = o.to(device, non_blocking=True), a.to(device, non_blocking=True)
            noise = torch.randn_like(a)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (a.shape[0],), device=device)
            loss = F.mse_loss(ddp(noise_sched.add_noise(a, noise, t), t, o), noise)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            running += torch.stack([loss.detach(), torch.ones_like(loss)])

        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch:4d} loss {(running[0] / running[1]).item():.5f} lr {sched.get_last_lr()[0]:.2e}")
            if (epoch + 1) % cfg.eval_every == 0:
                score = rollout(model, stats, cfg, device, seed=100_000)
                print(f"epoch {epoch:4d} PushT coverage {score:.3f}")
                torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "epoch": epoch,
                            "stats": stats, "score": score}, os.path.join(cfg.out_dir, f"ep{epoch + 1:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
