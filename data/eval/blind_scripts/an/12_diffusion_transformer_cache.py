"""Transformer diffusion policy on robomimic low-dim data with a cached zarr replay buffer.

The HDF5 demos are converted once into a compressed zarr store (abs actions,
rotation_6d) next to the dataset so later runs start fast.

    torchrun --nproc_per_node=8 12_diffusion_transformer_cache.py --dataset data/robomimic/transport/ph/low_dim_abs.hdf5
"""
import argparse
import hashlib
import math
import os
import shutil

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from diffusers import DDPMScheduler
from numcodecs import Blosc
from scipy.spatial.transform import Rotation
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
import wandb

OBS_KEYS = ["object", "robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos",
            "robot1_eef_pos", "robot1_eef_quat", "robot1_gripper_qpos"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--run_dir", default="data/outputs/dit_transport")
    p.add_argument("--n_obs_steps", type=int, default=2)
    p.add_argument("--horizon", type=int, default=10)
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_emb", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=1e-3)
    p.add_argument("--num_epochs", type=int, default=1000)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--ckpt_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def convert_actions(raw):
    # (N, 2 * 7) abs actions [pos3, axis-angle3, grip1] per arm -> pos3 + rot6d + grip1
    out = []
    for arm in raw.reshape(raw.shape[0], -1, 7).transpose(1, 0, 2):
        rot = Rotation.from_rotvec(arm[:, 3:6]).as_matrix()[:, :, :2].transpose(0, 2, 1).reshape(-1, 6)
        out.append(np.concatenate([arm[:, :3], rot, arm[:, 6:]], -1))
    return np.concatenate(out, -1).astype(np.float32)


def build_zarr_cache(hdf5_path, cache_path):
    compressor = Blosc(cname="zstd", clevel=5, shuffle=Blosc.NOSHUFFLE)
    store = zarr.ZipStore(cache_path, mode="w")
    root = zarr.group(store=store)
    obs_all, act_all, ends = [], [], []
    with h5py.File(hdf5_path, "r") as f:
        demos = sorted(f["data"].keys(), key=lambda k: int(k.split("_")[-1]))
        n = 0
        for k in demos:
            g = f[f"data/{k}"]
            obs_all.append(np.concatenate([g[f"obs/{o}"][()] for o in OBS_KEYS], -1).astype(np.float32))
            act_all.append(convert_actions(g["actions"][()]))
            n += len(act_all[-1])
            ends.append(n)
    root.create_dataset("data/obs", data=np.concatenate(obs_all), chunks=(1024, None), compressor=compressor)
    root.create_dataset("data/action", data=np.concatenate(act_all), chunks=(1024, None), compressor=compressor)
    root.create_dataset("meta/episode_ends", data=np.array(ends, dtype=np.int64))
    store.close()


def load_replay_buffer(hdf5_path):
    key = hashlib.md5((os.path.abspath(hdf5_path) + "|".join(OBS_KEYS)).encode()).hexdigest()[:10]
    cache_path = hdf5_path + f".{key}.zarr.zip"
    if not os.path.exists(cache_path):
        print(f"building replay buffer cache {cache_path}")
        build_zarr_cache(hdf5_path, cache_path)
    with zarr.ZipStore(cache_path, mode="r") as store:
        root = zarr.group(store=store)
        return {"obs": root["data/obs"][:], "action": root["data/action"][:],
                "episode_ends": root["meta/episode_ends"][:]}


class SequenceDataset(Dataset):
    def __init__(self, rb, horizon, n_obs_steps):
        self.obs, self.action = rb["obs"], rb["action"]
        self.H, self.To = horizon, n_obs_steps
        self.samples, s = [], 0
        for e in rb["episode_ends"]:
            for t in range(s - (n_obs_steps - 1), e - horizon + n_obs_steps):
                self.samples.append((s, e, t))
            s = e
        self.stats = {k: (v.min(0), v.max(0)) for k, v in (("obs", self.obs), ("action", self.action))}

    def normalize(self, key, x):
        lo, hi = self.stats[key]
        return (2 * (x - lo) / np.maximum(hi - lo, 1e-4) - 1).astype(np.float32)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s, e, t = self.samples[i]
        idx = np.clip(np.arange(t, t + self.H), s, e - 1)
        return (torch.from_numpy(self.normalize("obs", self.obs[idx[: self.To]])),
                torch.from_numpy(self.normalize("action", self.action[idx])))


class DiffusionTransformer(nn.Module):
    def __init__(self, act_dim, obs_dim, horizon, To, n_emb, n_layer):
        super().__init__()
        self.act_in = nn.Linear(act_dim, n_emb)
        self.obs_in = nn.Linear(obs_dim, n_emb)
        self.pos = nn.Parameter(torch.zeros(1, horizon, n_emb))
        self.cond_pos = nn.Parameter(torch.zeros(1, To + 1, n_emb))
        self.t_emb = nn.Sequential(nn.Linear(1, n_emb), nn.Mish(), nn.Linear(n_emb, n_emb))
        layer = nn.TransformerDecoderLayer(n_emb, 4, 4 * n_emb, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, n_layer)
        self.ln = nn.LayerNorm(n_emb)
        self.head = nn.Linear(n_emb, act_dim)
        mask = torch.triu(torch.full((horizon, horizon), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask)

    def forward(self, x, t, obs):
        cond = torch.cat([self.t_emb(t.float().view(-1, 1, 1) / 100.0), self.obs_in(obs)], 1) + self.cond_pos
        h = self.act_in(x) + self.pos
        h = self.decoder(h, cond, tgt_mask=self.causal_mask)
        return self.head(self.ln(h))


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    rb = load_replay_buffer(args.dataset)
    dataset = SequenceDataset(rb, args.horizon, args.n_obs_steps)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    obs_dim, act_dim = rb["obs"].shape[1], rb["action"].shape[1]
    model = DiffusionTransformer(act_dim, obs_dim, args.horizon, args.n_obs_steps, args.n_emb, args.n_layer)
    model = DDP(model.to(device), device_ids=[local_rank])
    noise_sched = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2",
                                clip_sample=True, prediction_type="epsilon")

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "pos" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    total = args.num_epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        wandb.init(project="diffusion_transformer", dir=args.run_dir, config=vars(args))

    global_step = 0
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for obs, action in loader:
            obs, action = obs.to(device, non_blocking=True), action.to(device, non_blocking=True)
            noise = torch.randn_like(action)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (action.shape[0],), device=device)
            pred = model(noise_sched.add_noise(action, noise, t), t, obs)
            loss = F.mse_loss(pred, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            global_step += 1
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(loss_sum)
        if rank == 0:
            wandb.log({"train_loss": (loss_sum[0] / loss_sum[1]).item(), "lr": sched.get_last_lr()[0],
                       "epoch": epoch}, step=global_step)
            if (epoch + 1) % args.ckpt_every == 0:
                ckpt = os.path.join(args.run_dir, "checkpoints", f"epoch={epoch:04d}.ckpt")
                os.makedirs(os.path.dirname(ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "normalizer": dataset.stats, "epoch": epoch}, ckpt)
                shutil.copyfile(ckpt, os.path.join(args.run_dir, "checkpoints", "latest.ckpt"))

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
