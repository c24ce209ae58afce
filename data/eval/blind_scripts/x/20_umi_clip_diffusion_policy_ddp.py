"""
UMI-style diffusion policy: CLIP ViT-B/16 image encoder (fine-tuned with a lower lr) + 1D conv UNet
denoiser, relative EE-pose actions, trained on a zarr replay buffer with DDP.

    torchrun --nproc_per_node=8 train_umi_dp.py --zarr data/cup_arrangement/replay_buffer.zarr
"""
import argparse
import math
import os

import numpy as np
import open_clip
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import zarr
from diffusers import DDIMScheduler
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb


class ReplayWindows(Dataset):
    def __init__(self, path, episodes, n_obs, horizon, stats):
        rb = zarr.open(path, "r")
        ends = rb["meta"]["episode_ends"][:]
        starts = np.concatenate([[0], ends[:-1]])
        self.rgb = rb["data"]["camera0_rgb"]
        self.pose = rb["data"]["robot0_eef_pos"][:]
        self.rot = rb["data"]["robot0_eef_rot_axis_angle"][:]
        self.grip = rb["data"]["robot0_gripper_width"][:]
        self.n_obs, self.h, self.stats = n_obs, horizon, stats
        self.items = [(starts[e], ends[e], t) for e in episodes for t in range(starts[e], ends[e] - 1)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, e, t = self.items[i]
        oi = np.clip(np.arange(t - self.n_obs + 1, t + 1), s, e - 1)
        ai = np.clip(np.arange(t, t + self.h), s, e - 1)
        img = torch.from_numpy(self.rgb[oi]).permute(0, 3, 1, 2).float() / 255.0
        cur = self.pose[t]
        rel_pos = self.pose[ai] - cur  # actions relative to the current EE position
        act = np.concatenate([rel_pos, self.rot[ai], self.grip[ai]], -1).astype(np.float32)
        low = np.concatenate([self.pose[oi] - cur, self.rot[oi], self.grip[oi]], -1).astype(np.float32)
        act = (act - self.stats["a_mean"]) / self.stats["a_std"]
        low = (low - self.stats["o_mean"]) / self.stats["o_std"]
        return {"img": img, "low": torch.from_numpy(low), "action": torch.from_numpy(act)}


class FiLMBlock(nn.Module):
    def __init__(self, cin, cout, cond):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(cout, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.film = nn.Sequential(nn.Mish(), nn.Linear(cond, 2 * cout))
        self.res = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, c):
        g, b = self.film(c)[..., None].chunk(2, 1)
        return self.conv2(self.conv1(x) * g + b) + self.res(x)


class ClipDiffusionPolicy(nn.Module):
    def __init__(self, action_dim, low_dim, n_obs, horizon, n_train_steps=50):
        super().__init__()
        clip, _, _ = open_clip.create_model_and_transforms("ViT-B-16", pretrained="openai")
        self.vision = clip.visual
        self.register_buffer("mean", torch.tensor([0.4815, 0.4578, 0.4082]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2686, 0.2613, 0.2758]).view(1, 3, 1, 1))
        cond = n_obs * (512 + low_dim) + 128
        self.temb = nn.Sequential(nn.Linear(128, 512), nn.Mish(), nn.Linear(512, 128))
        self.blocks = nn.ModuleList([FiLMBlock(action_dim, 256, cond), FiLMBlock(256, 512, cond),
                                     FiLMBlock(512, 256, cond)])
        self.out = nn.Conv1d(256, action_dim, 1)
        self.horizon, self.action_dim = horizon, action_dim
        self.noise_scheduler = DDIMScheduler(num_train_timesteps=n_train_steps, beta_schedule="squaredcos_cap_v2",
                                             prediction_type="epsilon", clip_sample=True)

    def cond(self, img, low):
        B, T = img.shape[:2]
        x = F.interpolate(img.flatten(0, 1), size=224, mode="bilinear", align_corners=False)
        f = self.vision((x - self.mean) / self.std).view(B, T, -1)
        return torch.cat([f, low], -1).flatten(1)

    def denoise(self, x, t, c):
        half = 64
        fr = torch.exp(-math.log(10000) * torch.arange(half, device=x.device) / half)
        te = self.temb(torch.cat([(t[:, None] * fr).sin(), (t[:, None] * fr).cos()], -1))
        c = torch.cat([c, te], -1)
        h = x.transpose(1, 2)
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(h).transpose(1, 2)

    def forward(self, batch):
        """Training loss."""
        a = batch["action"]
        c = self.cond(batch["img"], batch["low"])
        noise = torch.randn_like(a)
        t = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (a.shape[0],), device=a.device)
        return F.mse_loss(self.denoise(self.noise_scheduler.add_noise(a, noise, t), t, c), noise)

    @torch.no_grad()
    def predict_action(self, batch, n_steps=16):
        c = self.cond(batch["img"], batch["low"])
        x = torch.randn(c.shape[0], self.horizon, self.action_dim, device=c.device)
        self.noise_scheduler.set_timesteps(n_steps)
        for t in self.noise_scheduler.timesteps:
            x = self.noise_scheduler.step(self.denoise(x, t.expand(x.shape[0]).to(x.device), c), t, x).prev_sample
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--out", default="outputs/umi_dp")
    ap.add_argument("--n_obs", type=int, default=2)
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--vision_lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--val_every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    rb = zarr.open(args.zarr, "r")
    n_eps = len(rb["meta"]["episode_ends"])
    perm = np.random.RandomState(42).permutation(n_eps)
    val_eps, train_eps = perm[: max(1, n_eps // 20)], perm[max(1, n_eps // 20):]
    # normalization stats from a fixed subsample of training windows (identical on every rank)
    probe = ReplayWindows(args.zarr, train_eps, args.n_obs, args.horizon,
                          {"a_mean": 0.0, "a_std": 1.0, "o_mean": 0.0, "o_std": 1.0})
    pick = np.random.RandomState(0).choice(len(probe), size=min(5000, len(probe)), replace=False)
    acts = np.stack([probe[i]["action"].numpy() for i in pick])
    lows = np.stack([probe[i]["low"].numpy() for i in pick])
    stats = {"a_mean": acts.mean((0, 1)), "a_std": acts.std((0, 1)) + 1e-6,
             "o_mean": lows.mean((0, 1)), "o_std": lows.std((0, 1)) + 1e-6}

    train_ds = ReplayWindows(args.zarr, train_eps, args.n_obs, args.horizon, stats)
    val_ds = ReplayWindows(args.zarr, val_eps, args.n_obs, args.horizon, stats)
    tsamp = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    vsamp = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=tsamp, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=vsamp, num_workers=4, drop_last=True)

    torch.manual_seed(0)
    policy = ClipDiffusionPolicy(acts.shape[-1], lows.shape[-1], args.n_obs, args.horizon).to(device)
    policy = DDP(policy, device_ids=[local_rank])
    torch.manual_seed(rank + 1)
    ema = EMAModel(policy.module.parameters(), power=0.75)
    ema.to(device)
    vision = [p for n, p in policy.module.named_parameters() if n.startswith("vision.")]
    others = [p for n, p in policy.module.named_parameters() if not n.startswith("vision.")]
    opt = torch.optim.AdamW([{"params": others, "lr": args.lr}, {"params": vision, "lr": args.vision_lr}],
                            weight_decay=1e-6, betas=(0.95, 0.999))
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2000) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="umi-dp", config=vars(args))

    step = 0
    for epoch in range(args.epochs):
        tsamp.set_epoch(epoch)
        policy.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = policy(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            ema.step(policy.module.parameters())
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0]}, step=step)

        if (epoch + 1) % args.val_every == 0:
            # sampled-action error on held-out episodes with the EMA weights
            ema.store(policy.module.parameters())
            ema.copy_to(policy.module.parameters())
            policy.eval()
            err = torch.zeros(2, device=device)
            for batch in val_dl:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                pred = policy.predict_action(batch)
                err += torch.stack([F.mse_loss(pred, batch["action"], reduction="sum"),
                                    torch.tensor(float(pred.numel()), device=device)])
            ema.restore(policy.module.parameters())
            dist.all_reduce(err)
            if rank == 0:
                wandb.log({"val/action_mse": (err[0] / err[1]).item(), "epoch": epoch}, step=step)
                torch.save({"model": policy.module.state_dict(), "ema": ema.state_dict(), "stats": stats,
                            "epoch": epoch}, os.path.join(args.out, f"epoch_{epoch:04d}.ckpt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
