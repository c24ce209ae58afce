"""Flow-matching action-chunk policy (transformer head, ResNet-18 image encoder) on ALOHA sim data.

Training is preemptible: checkpoints go to <out>/checkpoints and `--resume auto` picks up the latest.

    torchrun --nproc_per_node=8 19_flow_matching_policy_resume.py --out /shared/runs/fm_transfer_cube --resume auto
"""
import argparse
import datetime
import glob
import math
import os
import re

import gymnasium as gym
import gym_aloha  # noqa: F401
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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--repo_id", default="lerobot/aloha_sim_transfer_cube_human")
    p.add_argument("--env_id", default="gym_aloha/AlohaTransferCube-v0")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="", help="'auto', a checkpoint path, or empty")
    p.add_argument("--chunk", type=int, default=50)
    p.add_argument("--d_model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--global_batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--save_every", type=int, default=5_000)
    p.add_argument("--eval_every", type=int, default=25_000)
    p.add_argument("--flow_steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class FlowPolicy(nn.Module):
    def __init__(self, state_dim, action_dim, chunk, d_model, layers, stats):
        super().__init__()
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=lambda c: nn.GroupNorm(c // 16, c))
        self.backbone = nn.Sequential(*list(rn.children())[:-2])
        self.img_proj = nn.Linear(512, d_model)
        self.state_proj = nn.Linear(state_dim, d_model)
        self.act_proj = nn.Linear(action_dim, d_model)
        self.time_mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.SiLU(), nn.Linear(d_model, d_model))
        self.obs_pos = nn.Parameter(torch.randn(1, 1 + 7 * 10, d_model) * 0.02)
        self.act_pos = nn.Parameter(torch.randn(1, chunk, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, 12, 4 * d_model, 0.0, activation="gelu", batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers)
        self.out = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, action_dim))
        self.d_model = d_model
        for k, v in stats.items():
            self.register_buffer(k, torch.as_tensor(v, dtype=torch.float32))

    def t_embed(self, t):
        half = self.d_model // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
        ang = 1000 * t[:, None] * freqs[None]
        return self.time_mlp(torch.cat([ang.sin(), ang.cos()], -1))

    def velocity(self, x_t, t, image, state):
        img = F.interpolate(image, size=(224, 320), mode="bilinear", align_corners=False)
        img = (img - torch.tensor([0.485, 0.456, 0.406], device=img.device).view(1, 3, 1, 1)) / \
            torch.tensor([0.229, 0.224, 0.225], device=img.device).view(1, 3, 1, 1)
        feats = self.img_proj(self.backbone(img).flatten(2).transpose(1, 2))  # (B, 70, d)
        obs = torch.cat([self.state_proj((state - self.state_mean) / self.state_std)[:, None], feats], 1) + self.obs_pos
        act = self.act_proj(x_t) + self.act_pos + self.t_embed(t)[:, None]
        h = self.transformer(torch.cat([obs, act], 1))
        return self.out(h[:, obs.shape[1]:])

    def forward(self, image, state, action):
        """Rectified-flow loss on the normalised action chunk."""
        a = (action - self.action_mean) / self.action_std
        noise = torch.randn_like(a)
        t = torch.rand(a.shape[0], device=a.device)
        x_t = (1 - t[:, None, None]) * noise + t[:, None, None] * a
        return self.velocity(x_t, t, image, state), a - noise

    @torch.no_grad()
    def sample(self, image, state, n_steps):
        x = torch.randn(image.shape[0], self.act_pos.shape[1], self.action_mean.shape[0], device=image.device)
        for i in range(n_steps):
            t = torch.full((x.shape[0],), i / n_steps, device=x.device)
            x = x + self.velocity(x, t, image, state) / n_steps
        return x * self.action_std + self.action_mean


@torch.no_grad()
def eval_rollouts(policy, env_id, n, flow_steps, device):
    env = gym.make(env_id, obs_type="pixels_agent_pos", max_episode_steps=400)
    policy.eval()
    succ = 0
    for ep in range(n):
        obs, _ = env.reset(seed=7_000 + ep)
        done, best = False, 0.0
        while not done:
            img = torch.as_tensor(obs["pixels"]["top"], device=device).permute(2, 0, 1)[None].float() / 255
            st = torch.as_tensor(obs["agent_pos"], device=device)[None].float()
            for a in policy.sample(img, st, flow_steps)[0].cpu().numpy():
                obs, r, term, trunc, _ = env.step(a)
                best, done = max(best, r), term or trunc
                if done:
                    break
        succ += int(best >= env.unwrapped.task.max_reward)
    policy.train()
    env.close()
    return succ / n


def find_latest(ckpt_dir):
    paths = glob.glob(os.path.join(ckpt_dir, "step_*.pt"))
    return max(paths, key=lambda p: int(re.findall(r"step_(\d+)", p)[0])) if paths else None


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    ckpt_dir = os.path.join(args.out, "checkpoints")

    fps = 50
    if rank == 0:
        LeRobotDataset(args.repo_id)  # fetch from the hub once
    dist.barrier()
    dataset = LeRobotDataset(args.repo_id, delta_timestamps={"action": [i / fps for i in range(args.chunk)]})
    s = dataset.meta.stats
    stats = {"state_mean": s["observation.state"]["mean"], "state_std": s["observation.state"]["std"],
             "action_mean": s["action"]["mean"], "action_std": s["action"]["std"]}
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    policy = FlowPolicy(14, 14, args.chunk, args.d_model, args.layers, stats).to(device)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 2000) * 0.5 * (1 + math.cos(math.pi * min(i, args.steps) / args.steps)))

    step, epoch = 0, 0
    resume_path = find_latest(ckpt_dir) if args.resume == "auto" else args.resume
    if resume_path:
        ckpt = torch.load(resume_path)
        policy.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        step, epoch = ckpt["step"], ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {resume_path} at step {step}")
        del ckpt
    model = DDP(policy, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            image = batch["observation.images.top"].to(device, non_blocking=True)
            state = batch["observation.state"].to(device, non_blocking=True)
            action = batch["action"].to(device, non_blocking=True)
            valid = ~batch["action_is_pad"].to(device, non_blocking=True)
            v_pred, v_target = model(image, state, action)
            loss = (((v_pred - v_target) ** 2).mean(-1) * valid).sum() / valid.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} epoch {epoch} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
            if step % args.save_every == 0 and rank == 0:
                torch.save({"model": policy.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(ckpt_dir, f"step_{step:07d}.pt"))
            if step % args.eval_every == 0:
                if rank == 0:
                    sr = eval_rollouts(policy, args.env_id, 50, args.flow_steps, device)
                    print(f"step {step}: success rate {sr:.2%}")
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
