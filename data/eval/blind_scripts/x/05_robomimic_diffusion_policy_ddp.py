"""
Diffusion Policy (CNN) on robomimic image datasets (lift / can / square, ph + mh), multi-GPU.

Each rank loads its share of the demos into RAM once (the image hdf5 files are ~30GB, we do not
want 8 copies), then samples windows from them.

    torchrun --nproc_per_node 8 train_dp_robomimic.py --hdf5 data/square/mh/image_abs.hdf5
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from diffusers import DDPMScheduler
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import wandb

OBS_KEYS = ["agentview_image", "robot0_eye_in_hand_image"]
LOWDIM_KEYS = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"]


class SequenceDataset(Dataset):
    def __init__(self, path, demo_keys, horizon, n_obs, stats):
        self.horizon, self.n_obs = horizon, n_obs
        self.episodes = []
        with h5py.File(path, "r") as f:
            for k in demo_keys:
                g = f["data"][k]
                ep = {key: g["obs"][key][()] for key in OBS_KEYS + LOWDIM_KEYS}
                ep["actions"] = g["actions"][()].astype(np.float32)
                self.episodes.append(ep)
        self.index = [(e, t) for e, ep in enumerate(self.episodes)
                      for t in range(len(ep["actions"]) - 1)]
        self.stats = stats

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        e, t = self.index[i]
        ep = self.episodes[e]
        T = len(ep["actions"])
        obs_idx = np.clip(np.arange(t - self.n_obs + 1, t + 1), 0, T - 1)
        act_idx = np.clip(np.arange(t - self.n_obs + 1, t - self.n_obs + 1 + self.horizon), 0, T - 1)
        imgs = [torch.from_numpy(ep[k][obs_idx]).permute(0, 3, 1, 2).float() / 255.0 for k in OBS_KEYS]
        low = np.concatenate([ep[k][obs_idx] for k in LOWDIM_KEYS], -1)
        s = self.stats
        low = 2 * (low - s["s_min"]) / (s["s_max"] - s["s_min"] + 1e-6) - 1
        act = 2 * (ep["actions"][act_idx] - s["a_min"]) / (s["a_max"] - s["a_min"] + 1e-6) - 1
        return {"images": torch.stack(imgs, 1), "lowdim": torch.from_numpy(low).float(),
                "action": torch.from_numpy(act).float()}


def resnet18_gn():
    m = torchvision.models.resnet18(weights=None)
    # BatchNorm -> GroupNorm, as in the diffusion policy paper (EMA + BN do not mix well)
    def swap(mod):
        for name, child in mod.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(mod, name, nn.GroupNorm(child.num_features // 16, child.num_features))
            else:
                swap(child)
    swap(m)
    m.fc = nn.Identity()
    return m


class Cond1dBlock(nn.Module):
    def __init__(self, cin, cout, cond_dim):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.c2 = nn.Sequential(nn.Conv1d(cout, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.film = nn.Linear(cond_dim, 2 * cout)
        self.res = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, c):
        h = self.c1(x)
        scale, bias = self.film(c).unsqueeze(-1).chunk(2, 1)
        h = self.c2(h * (1 + scale) + bias)
        return h + self.res(x)


class DiffusionPolicy(nn.Module):
    def __init__(self, action_dim, lowdim, n_obs, n_cams=2):
        super().__init__()
        self.encoders = nn.ModuleList([resnet18_gn() for _ in range(n_cams)])
        cond_dim = n_obs * (512 * n_cams + lowdim) + 128
        self.t_emb = nn.Sequential(nn.Linear(1, 128), nn.Mish(), nn.Linear(128, 128))
        self.down = nn.ModuleList([Cond1dBlock(action_dim, 256, cond_dim), Cond1dBlock(256, 512, cond_dim),
                                   Cond1dBlock(512, 1024, cond_dim)])
        self.up = nn.ModuleList([Cond1dBlock(2048, 512, cond_dim), Cond1dBlock(1024, 256, cond_dim)])
        self.final = nn.Conv1d(256, action_dim, 1)

    def encode_obs(self, images, lowdim):
        b, t = images.shape[:2]
        feats = [enc(images[:, :, i].flatten(0, 1)).view(b, t, -1) for i, enc in enumerate(self.encoders)]
        return torch.cat(feats + [lowdim], -1).flatten(1)

    def forward(self, noisy, timesteps, images, lowdim):
        obs_cond = self.encode_obs(images, lowdim)
        c = torch.cat([obs_cond, self.t_emb(timesteps.float().unsqueeze(-1) / 100.0)], -1)
        x = noisy.transpose(1, 2)
        skips = []
        for blk in self.down:
            x = blk(x, c)
            skips.append(x)
        for blk in self.up:
            x = blk(torch.cat([x, skips.pop()], 1), c)
        return self.final(x).transpose(1, 2)


def compute_stats(path, demo_keys):
    acts, low = [], []
    with h5py.File(path, "r") as f:
        for k in demo_keys:
            g = f["data"][k]
            acts.append(g["actions"][()])
            low.append(np.concatenate([g["obs"][key][()] for key in LOWDIM_KEYS], -1))
    acts, low = np.concatenate(acts), np.concatenate(low)
    return {"a_min": acts.min(0), "a_max": acts.max(0), "s_min": low.min(0), "s_max": low.max(0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdf5", required=True)
    ap.add_argument("--out", default="outputs/dp_square")
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--n_obs", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--val_ratio", type=float, default=0.02)
    ap.add_argument("--ckpt_every", type=int, default=50)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    with h5py.File(args.hdf5, "r") as f:
        demos = sorted(f["data"].keys(), key=lambda k: int(k.split("_")[1]))
    rng = np.random.default_rng(0)
    rng.shuffle(demos)
    n_val = max(1, int(len(demos) * args.val_ratio))
    val_demos, train_demos = demos[:n_val], demos[n_val:]

    # global normalizer from all training demos so every rank normalizes identically
    obj = [compute_stats(args.hdf5, train_demos) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    stats = obj[0]

    train_set = SequenceDataset(args.hdf5, train_demos[rank::world], args.horizon, args.n_obs, stats)
    val_set = SequenceDataset(args.hdf5, val_demos, args.horizon, args.n_obs, stats)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=2)

    action_dim = train_set.episodes[0]["actions"].shape[-1]
    lowdim = sum(train_set.episodes[0][k].shape[-1] for k in LOWDIM_KEYS)
    policy = DiffusionPolicy(action_dim, lowdim, args.n_obs).to(device)
    policy = DDP(policy, device_ids=[local_rank])
    ema = EMAModel(policy.module.parameters(), power=0.75, max_value=0.9999)
    ema.to(device)
    noise_sched = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2",
                                clip_sample=True, prediction_type="epsilon")
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.01, anneal_strategy="cos")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="diffusion-policy-robomimic", config=vars(args))

    step = 0
    for epoch in range(args.epochs):
        policy.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            noise = torch.randn_like(batch["action"])
            ts = torch.randint(0, 100, (noise.shape[0],), device=device)
            noisy = noise_sched.add_noise(batch["action"], noise, ts)
            pred = policy(noisy, ts, batch["images"], batch["lowdim"])
            loss = F.mse_loss(pred, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema.step(policy.module.parameters())
            step += 1
            if rank == 0 and step % 100 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

        # validation on the held-out demos with EMA weights (every rank runs it, results are averaged)
        ema.store(policy.module.parameters())
        ema.copy_to(policy.module.parameters())
        policy.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                noise = torch.randn_like(batch["action"])
                ts = torch.randint(0, 100, (noise.shape[0],), device=device)
                pred = policy.module(noise_sched.add_noise(batch["action"], noise, ts), ts,
                                     batch["images"], batch["lowdim"])
                tot += torch.stack([F.mse_loss(pred, noise, reduction="sum"),
                                    torch.tensor(float(noise.numel()), device=device)])
        ema.restore(policy.module.parameters())
        dist.all_reduce(tot)
        if rank == 0:
            wandb.log({"val/loss": (tot[0] / tot[1]).item(), "epoch": epoch, "epoch_time": time.time() - t0},
                      step=step)
            if (epoch + 1) % args.ckpt_every == 0:
                torch.save({"policy": policy.module.state_dict(), "ema": ema.state_dict(), "stats": stats,
                            "opt": opt.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"epoch_{epoch:04d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
