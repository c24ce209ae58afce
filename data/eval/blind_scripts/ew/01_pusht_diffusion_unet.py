#!/usr/bin/env python
"""Diffusion Policy (CNN / 1D temporal UNet) on the PushT image demonstrations.

Data is the zarr replay buffer released with the Diffusion Policy paper
(pusht_cchi_v7_replay.zarr): data/img, data/state, data/action, meta/episode_ends.

    torchrun --standalone --nproc_per_node=4 01_pusht_diffusion_unet.py \
        --zarr data/pusht/pusht_cchi_v7_replay.zarr --out outputs/pusht_dp
"""
import argparse
import copy
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import zarr
from diffusers.optimization import get_scheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--zarr", required=True)
    p.add_argument("--out", default="outputs/pusht_dp")
    p.add_argument("--obs_horizon", type=int, default=2)
    p.add_argument("--pred_horizon", type=int, default=16)
    p.add_argument("--action_horizon", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=256, help="global batch size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=1e-6)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--diffusion_steps", type=int, default=100)
    p.add_argument("--ema_decay", type=float, default=0.999)
    p.add_argument("--save_every", type=int, default=50)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


# --------------------------------------------------------------------------- data
class Normalizer:
    """Min-max normalisation to [-1, 1], fitted over the whole replay buffer."""

    def __init__(self, stats):
        self.stats = stats

    @classmethod
    def fit(cls, arrays, device):
        stats = {}
        for k, v in arrays.items():
            x = torch.from_numpy(np.asarray(v)).float().to(device)
            x = x.reshape(-1, x.shape[-1])
            stats[k] = {"min": x.min(0).values, "max": x.max(0).values}
        return cls(stats)

    def normalize(self, key, x):
        s = self.stats[key]
        x = x.to(s["min"].device, torch.float32)
        rng = (s["max"] - s["min"]).clamp_min(1e-6)
        return (x - s["min"]) / rng * 2.0 - 1.0

    def unnormalize(self, key, x):
        s = self.stats[key]
        rng = (s["max"] - s["min"]).clamp_min(1e-6)
        return (x + 1.0) / 2.0 * rng + s["min"]

    def state_dict(self):
        return {k: {kk: vv.cpu() for kk, vv in v.items()} for k, v in self.stats.items()}


def create_sample_indices(episode_ends, sequence_length, pad_before=0, pad_after=0):
    indices = []
    for i in range(len(episode_ends)):
        start_idx = 0 if i == 0 else episode_ends[i - 1]
        end_idx = episode_ends[i]
        episode_length = end_idx - start_idx
        min_start = -pad_before
        max_start = episode_length - sequence_length + pad_after
        for idx in range(min_start, max_start + 1):
            buffer_start = max(idx, 0) + start_idx
            buffer_end = min(idx + sequence_length, episode_length) + start_idx
            start_offset = buffer_start - (idx + start_idx)
            end_offset = (idx + sequence_length + start_idx) - buffer_end
            indices.append([buffer_start, buffer_end, start_offset, sequence_length - end_offset])
    return np.array(indices, dtype=np.int64)


def sample_sequence(arr, sequence_length, buffer_start, buffer_end, sample_start, sample_end):
    sample = arr[buffer_start:buffer_end]
    if sample_start == 0 and sample_end == sequence_length:
        return sample
    data = np.zeros((sequence_length,) + arr.shape[1:], dtype=arr.dtype)
    if sample_start > 0:
        data[:sample_start] = sample[0]
    if sample_end < sequence_length:
        data[sample_end:] = sample[-1]
    data[sample_start:sample_end] = sample
    return data


class PushTImageDataset(Dataset):
    def __init__(self, root, pred_horizon, obs_horizon, action_horizon, normalizer):
        episode_ends = root["meta"]["episode_ends"][:]
        self.img = root["data"]["img"][:]  # (N, 96, 96, 3) uint8
        self.agent_pos = root["data"]["state"][:, :2].astype(np.float32)
        self.action = root["data"]["action"][:].astype(np.float32)
        self.indices = create_sample_indices(
            episode_ends, pred_horizon, pad_before=obs_horizon - 1, pad_after=action_horizon - 1
        )
        self.pred_horizon = pred_horizon
        self.obs_horizon = obs_horizon
        self.normalizer = normalizer

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, idx):
        b0, b1, s0, s1 = self.indices[idx]
        img = sample_sequence(self.img, self.pred_horizon, b0, b1, s0, s1)[: self.obs_horizon]
        pos = sample_sequence(self.agent_pos, self.pred_horizon, b0, b1, s0, s1)[: self.obs_horizon]
        act = sample_sequence(self.action, self.pred_horizon, b0, b1, s0, s1)
        img = torch.from_numpy(np.ascontiguousarray(img)).permute(0, 3, 1, 2).float() / 255.0
        return {
            "image": img,
            "agent_pos": self.normalizer.normalize("agent_pos", torch.from_numpy(pos)),
            "action": self.normalizer.normalize("action", torch.from_numpy(act)),
        }


# -------------------------------------------------------------------------- model
def replace_bn_with_gn(module, features_per_group=16):
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, nn.GroupNorm(child.num_features // features_per_group, child.num_features))
        else:
            replace_bn_with_gn(child, features_per_group)
    return module


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        half = self.dim // 2
        freq = torch.exp(torch.arange(half, device=t.device) * -(math.log(10000) / (half - 1)))
        emb = t[:, None].float() * freq[None, :]
        return torch.cat([emb.sin(), emb.cos()], dim=-1)


class Conv1dBlock(nn.Sequential):
    def __init__(self, c_in, c_out, k, n_groups=8):
        super().__init__(nn.Conv1d(c_in, c_out, k, padding=k // 2), nn.GroupNorm(n_groups, c_out), nn.Mish())


class CondResBlock1D(nn.Module):
    def __init__(self, c_in, c_out, cond_dim, k=5, n_groups=8):
        super().__init__()
        self.block1 = Conv1dBlock(c_in, c_out, k, n_groups)
        self.block2 = Conv1dBlock(c_out, c_out, k, n_groups)
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, c_out * 2))
        self.residual = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x, cond):
        out = self.block1(x)
        scale, bias = self.cond_encoder(cond).unsqueeze(-1).chunk(2, dim=1)
        out = self.block2(scale * out + bias)
        return out + self.residual(x)


class ConditionalUnet1D(nn.Module):
    def __init__(self, input_dim, global_cond_dim, step_dim=256, down_dims=(256, 512, 1024), k=5):
        super().__init__()
        self.step_emb = nn.Sequential(
            SinusoidalPosEmb(step_dim), nn.Linear(step_dim, step_dim * 4), nn.Mish(), nn.Linear(step_dim * 4, step_dim)
        )
        cond_dim = step_dim + global_cond_dim
        dims = [input_dim, *down_dims]
        in_out = list(zip(dims[:-1], dims[1:]))
        self.down = nn.ModuleList()
        for i, (a, b) in enumerate(in_out):
            last = i == len(in_out) - 1
            self.down.append(nn.ModuleList([
                CondResBlock1D(a, b, cond_dim, k), CondResBlock1D(b, b, cond_dim, k),
                nn.Conv1d(b, b, 3, 2, 1) if not last else nn.Identity(),
            ]))
        mid = down_dims[-1]
        self.mid = nn.ModuleList([CondResBlock1D(mid, mid, cond_dim, k), CondResBlock1D(mid, mid, cond_dim, k)])
        self.up = nn.ModuleList()
        for a, b in reversed(in_out[1:]):
            self.up.append(nn.ModuleList([
                CondResBlock1D(b * 2, a, cond_dim, k), CondResBlock1D(a, a, cond_dim, k),
                nn.ConvTranspose1d(a, a, 4, 2, 1),
            ]))
        self.final = nn.Sequential(Conv1dBlock(down_dims[0], down_dims[0], k), nn.Conv1d(down_dims[0], input_dim, 1))

    def forward(self, sample, timestep, global_cond):
        x = sample.moveaxis(-1, -2)
        cond = torch.cat([self.step_emb(timestep), global_cond], dim=-1)
        skips = []
        for res1, res2, down in self.down:
            x = res2(res1(x, cond), cond)
            skips.append(x)
            x = down(x)
        for m in self.mid:
            x = m(x, cond)
        for res1, res2, up in self.up:
            x = torch.cat([x, skips.pop()], dim=1)
            x = up(res2(res1(x, cond), cond))
        return self.final(x).moveaxis(-1, -2)


class DiffusionPolicy(nn.Module):
    def __init__(self, obs_horizon, action_dim=2, lowdim=2):
        super().__init__()
        backbone = torchvision.models.resnet18(weights=None)
        backbone.fc = nn.Identity()
        self.vision = replace_bn_with_gn(backbone)
        self.noise_pred = ConditionalUnet1D(action_dim, global_cond_dim=obs_horizon * (512 + lowdim))

    def encode_obs(self, image, agent_pos):
        B, T = image.shape[:2]
        feat = self.vision(image.flatten(0, 1)).reshape(B, T, -1)
        return torch.cat([feat, agent_pos], dim=-1).flatten(1)

    def forward(self, image, agent_pos, noisy_action, timesteps):
        return self.noise_pred(noisy_action, timesteps, self.encode_obs(image, agent_pos))


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for pe, p in zip(ema_model.parameters(), model.parameters()):
        pe.mul_(decay).add_(p.detach(), alpha=1.0 - decay)


# --------------------------------------------------------------------------- main
def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    is_main = rank == 0

    root = zarr.open(args.zarr, mode="r")
    normalizer = Normalizer.fit(
        {"agent_pos": root["data"]["state"][:, :2], "action": root["data"]["action"][:]}, device
    )
    dataset = PushTImageDataset(root, args.pred_horizon, args.obs_horizon, args.action_horizon, normalizer)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=args.batch_size // world_size, sampler=sampler,
        num_workers=args.num_workers, persistent_workers=True, drop_last=True,
    )

    policy = DiffusionPolicy(args.obs_horizon).to(device)
    ema_policy = copy.deepcopy(policy).eval().requires_grad_(False)
    policy = DDP(policy, device_ids=[local_rank], output_device=local_rank)

    noise_scheduler = DDPMScheduler(
        num_train_timesteps=args.diffusion_steps, beta_schedule="squaredcos_cap_v2",
        clip_sample=True, prediction_type="epsilon",
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = get_scheduler(
        "cosine", optimizer=optimizer, num_warmup_steps=500, num_training_steps=len(loader) * args.epochs
    )

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(vars(args) | {"world_size": world_size}, f, indent=2)
        print(f"{len(dataset)} samples, {len(loader)} steps/epoch/rank on {world_size} GPUs")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        policy.train()
        t0 = time.time()
        for batch in loader:
            image = batch["image"].to(device, non_blocking=True)
            agent_pos = batch["agent_pos"].to(device, non_blocking=True)
            action = batch["action"].to(device, non_blocking=True)

            noise = torch.randn_like(action)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (action.shape[0],), device=device)
            noisy_action = noise_scheduler.add_noise(action, noise, timesteps)
            loss = F.mse_loss(policy(image, agent_pos, noisy_action, timesteps), noise)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            ema_update(ema_policy, policy.module, args.ema_decay)
            step += 1

            if step % args.log_every == 0:
                loss_avg = loss.detach().clone()
                dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
                if is_main:
                    print(f"epoch {epoch} step {step} loss {loss_avg.item():.5f} lr {lr_scheduler.get_last_lr()[0]:.2e}")

        if is_main:
            print(f"epoch {epoch} done in {time.time() - t0:.1f}s")
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({
                    "epoch": epoch,
                    "model": policy.module.state_dict(),
                    "ema": ema_policy.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "normalizer": normalizer.state_dict(),
                }, os.path.join(args.out, f"epoch_{epoch + 1:04d}.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
