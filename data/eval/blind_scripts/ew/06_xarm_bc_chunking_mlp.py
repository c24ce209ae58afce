"""Behaviour cloning with observation history + action chunking on lerobot/xarm_lift_medium.

    torchrun --nproc_per_node=4 06_xarm_bc_chunking_mlp.py
    torchrun --nproc_per_node=4 06_xarm_bc_chunking_mlp.py --train_steps 200000 --chunk 24
"""
import argparse
import dataclasses
import datetime
import os
import time
from dataclasses import dataclass

import gymnasium as gym
import gym_xarm  # noqa: F401
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class TrainConfig:
    repo_id: str = "lerobot/xarm_lift_medium"
    env_id: str = "gym_xarm/XarmLift-v0"
    fps: int = 15
    n_obs_steps: int = 2
    chunk: int = 16
    n_action_steps: int = 8
    global_batch_size: int = 256
    lr: float = 3e-4
    weight_decay: float = 1e-4
    train_steps: int = 100_000
    warmup_steps: int = 1000
    log_every: int = 200
    eval_every: int = 10_000
    eval_episodes: int = 20
    num_workers: int = 6
    device: str = "cuda:0"
    out_dir: str = "outputs/xarm_bc_chunk"
    seed: int = 7


def parse_config() -> TrainConfig:
    parser = argparse.ArgumentParser()
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return TrainConfig(**vars(parser.parse_args()))


class Normalizer(nn.Module):
    """mean/std normalisation with the statistics LeRobot ships with the dataset."""

    def __init__(self, stats, keys):
        super().__init__()
        for k in keys:
            name = k.replace(".", "_")
            self.register_buffer(f"{name}_mean", torch.as_tensor(np.asarray(stats[k]["mean"]), dtype=torch.float32))
            self.register_buffer(f"{name}_std", torch.as_tensor(np.asarray(stats[k]["std"]), dtype=torch.float32))

    def _ms(self, key):
        name = key.replace(".", "_")
        return getattr(self, f"{name}_mean"), getattr(self, f"{name}_std")

    def normalize(self, key, x):
        m, s = self._ms(key)
        return (x - m) / (s + 1e-8)

    def unnormalize(self, key, x):
        m, s = self._ms(key)
        return x * (s + 1e-8) + m


class ChunkingBC(nn.Module):
    def __init__(self, state_dim, action_dim, n_obs_steps, chunk, hidden=1024):
        super().__init__()
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        rn.fc = nn.Identity()
        # GroupNorm instead of BatchNorm: small per-GPU batches and EMA-free eval
        self.encoder = self._bn_to_gn(rn)
        self.mlp = nn.Sequential(
            nn.Linear(n_obs_steps * (512 + state_dim), hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, chunk * action_dim),
        )
        self.chunk, self.action_dim = chunk, action_dim

    @staticmethod
    def _bn_to_gn(m):
        for name, child in m.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(m, name, nn.GroupNorm(child.num_features // 16, child.num_features))
            else:
                ChunkingBC._bn_to_gn(child)
        return m

    def forward(self, image, state):
        B, T = image.shape[:2]
        feat = self.encoder(image.flatten(0, 1)).view(B, T, -1)
        x = torch.cat([feat, state], -1).flatten(1)
        return self.mlp(x).view(B, self.chunk, self.action_dim)


@torch.no_grad()
def evaluate(model, normalizer, cfg, device):
    env = gym.make(cfg.env_id, obs_type="pixels_agent_pos", visualization_width=84, visualization_height=84)
    model.eval()
    successes = []
    for ep in range(cfg.eval_episodes):
        obs, _ = env.reset(seed=50_000 + ep)
        hist, success, done = [obs] * cfg.n_obs_steps, False, False
        while not done:
            img = torch.stack([torch.from_numpy(o["pixels"]).permute(2, 0, 1).float() / 255 for o in hist[-cfg.n_obs_steps:]])
            st = torch.stack([torch.from_numpy(o["agent_pos"]).float() for o in hist[-cfg.n_obs_steps:]])
            img, st = img.to(device)[None], normalizer.normalize("observation.state", st.to(device))[None]
            actions = normalizer.unnormalize("action", model(img, st))[0, : cfg.n_action_steps]
            for a in actions.cpu().numpy():
                obs, _, terminated, truncated, info = env.step(a)
                hist.append(obs)
                success |= bool(info.get("is_success", False))
                done = terminated or truncated
                if done:
                    break
        successes.append(success)
    env.close()
    model.train()
    return float(np.mean(successes))


def main():
    cfg = parse_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed + rank)
    device = torch.device(cfg.device)

    dt = 1.0 / cfg.fps
    obs_ts = [-(cfg.n_obs_steps - 1 - i) * dt for i in range(cfg.n_obs_steps)]
    if rank == 0:
        LeRobotDataset(cfg.repo_id)  # download once before the other ranks open it
    dist.barrier()
    dataset = LeRobotDataset(cfg.repo_id, delta_timestamps={
        "observation.image": obs_ts,
        "observation.state": obs_ts,
        "action": [i * dt for i in range(-(cfg.n_obs_steps - 1), cfg.chunk - (cfg.n_obs_steps - 1))],
    })
    stats = dataset.meta.stats
    normalizer = Normalizer(stats, ["observation.state", "action"]).to(device)
    state_dim, action_dim = len(stats["observation.state"]["mean"]), len(stats["action"]["mean"])

    per_gpu_batch = cfg.global_batch_size // world_size
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=per_gpu_batch, sampler=sampler, num_workers=cfg.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = ChunkingBC(state_dim, action_dim, cfg.n_obs_steps, cfg.chunk).cuda()
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * 0.5 * (1 + np.cos(np.pi * s / cfg.train_steps))
    )

    writer = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        writer = SummaryWriter(cfg.out_dir)
        print(f"{dataset.num_episodes} episodes / {len(dataset)} frames, per-GPU batch {per_gpu_batch}")

    step, epoch, t0 = 0, 0, time.time()
    while step < cfg.train_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            image = batch["observation.image"].to(device, non_blocking=True)
            state = normalizer.normalize("observation.state", batch["observation.state"].to(device, non_blocking=True))
            target = normalizer.normalize("action", batch["action"].to(device, non_blocking=True))
            pad = batch["action_is_pad"].to(device, non_blocking=True)

            pred = ddp_model(image, state)
            loss = (F.l1_loss(pred, target, reduction="none").mean(-1) * ~pad).sum() / (~pad).sum().clamp_min(1)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % cfg.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/l1", l.item(), step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
                    print(f"step {step} l1 {l.item():.4f} ({(time.time() - t0) / cfg.log_every:.3f}s/it)")
                    t0 = time.time()

            if step % cfg.eval_every == 0:
                if rank == 0:
                    sr = evaluate(model, normalizer, cfg, device)
                    writer.add_scalar("eval/success_rate", sr, step)
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "step": step, "config": dataclasses.asdict(cfg)},
                               os.path.join(cfg.out_dir, f"step_{step:07d}.pt"))
                    print(f"step {step}: success rate {sr:.2f}")
                dist.barrier()
            if step >= cfg.train_steps:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
