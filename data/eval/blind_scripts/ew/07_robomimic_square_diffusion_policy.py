"""Image-based Diffusion Policy (UNet) on robomimic square/ph, multi-GPU with DDP.

    torchrun --standalone --nproc_per_node=8 07_robomimic_square_diffusion_policy.py \
        --dataset data/robomimic/square/ph/image_abs.hdf5 --run_dir runs/dp_square
    # resume
    torchrun --standalone --nproc_per_node=8 07_robomimic_square_diffusion_policy.py \
        --dataset data/robomimic/square/ph/image_abs.hdf5 --run_dir runs/dp_square --resume runs/dp_square/latest.ckpt
"""
import argparse
import copy
import datetime
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import robomimic.utils.env_utils as EnvUtils
import robomimic.utils.file_utils as FileUtils
import robomimic.utils.obs_utils as ObsUtils
from diffusers import DDPMScheduler
from diffusers.optimization import get_cosine_schedule_with_warmup
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RGB_KEYS = ["agentview_image", "robot0_eye_in_hand_image"]
LOWDIM_KEYS = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"]

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", required=True)
parser.add_argument("--run_dir", required=True)
parser.add_argument("--resume", default=None)
parser.add_argument("--n_obs_steps", type=int, default=2)
parser.add_argument("--horizon", type=int, default=16)
parser.add_argument("--n_action_steps", type=int, default=8)
parser.add_argument("--batch_size", type=int, default=64, help="per GPU")
parser.add_argument("--base_lr", type=float, default=1e-4, help="lr for a global batch of 64")
parser.add_argument("--epochs", type=int, default=3000)
parser.add_argument("--rollout_every", type=int, default=50)
parser.add_argument("--n_rollouts", type=int, default=50)
parser.add_argument("--max_steps", type=int, default=400)
parser.add_argument("--seed", type=int, default=42)


def load_demos(path):
    demos = []
    with h5py.File(path, "r") as f:
        keys = sorted(f["data"].keys(), key=lambda k: int(k.split("_")[-1]))
        for k in keys:
            g = f["data"][k]
            demos.append({
                **{c: g["obs"][c][()] for c in RGB_KEYS},
                "lowdim": np.concatenate([g["obs"][c][()] for c in LOWDIM_KEYS], -1).astype(np.float32),
                "action": g["actions"][()].astype(np.float32),
            })
    return demos


def fit_minmax(demos):
    out = {}
    for key in ("lowdim", "action"):
        x = np.concatenate([d[key] for d in demos])
        out[f"{key}_min"], out[f"{key}_max"] = x.min(0), x.max(0)
    return out


class DemoWindows(Dataset):
    def __init__(self, demos, stats, n_obs_steps, horizon):
        self.demos, self.n_obs, self.horizon = demos, n_obs_steps, horizon
        self.s = stats
        self.index = [(i, t) for i, d in enumerate(demos) for t in range(-(n_obs_steps - 1), len(d["action"]) - 1)]

    def _norm(self, x, key):
        lo, hi = self.s[f"{key}_min"], self.s[f"{key}_max"]
        return (x - lo) / np.maximum(hi - lo, 1e-6) * 2 - 1

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d_idx, t = self.index[i]
        d = self.demos[d_idx]
        T = len(d["action"])
        steps = np.clip(np.arange(t, t + self.horizon), 0, T - 1)
        obs_steps = steps[: self.n_obs]
        item = {c: torch.from_numpy(d[c][obs_steps]).permute(0, 3, 1, 2).float() / 255.0 for c in RGB_KEYS}
        item["lowdim"] = torch.from_numpy(self._norm(d["lowdim"][obs_steps], "lowdim")).float()
        item["action"] = torch.from_numpy(self._norm(d["action"][steps], "action")).float()
        return item


def resnet18_gn():
    net = torchvision.models.resnet18(weights=None, norm_layer=lambda c: nn.GroupNorm(c // 16, c))
    net.fc = nn.Identity()
    return net


class DenoiseNet(nn.Module):
    """Observation encoders + FiLM-conditioned temporal conv net over the action sequence."""

    def __init__(self, action_dim, lowdim_dim, n_obs_steps, emb=256, channels=(256, 512, 1024)):
        super().__init__()
        self.rgb_enc = nn.ModuleList([resnet18_gn() for _ in RGB_KEYS])
        cond_dim = n_obs_steps * (512 * len(RGB_KEYS) + lowdim_dim) + emb
        self.t_emb = nn.Sequential(nn.Linear(1, emb), nn.Mish(), nn.Linear(emb, emb))
        self.inp = nn.Conv1d(action_dim, channels[0], 5, padding=2)
        self.blocks = nn.ModuleList()
        self.films = nn.ModuleList()
        prev = channels[0]
        for c in channels + channels[::-1][1:]:
            self.blocks.append(nn.Sequential(nn.Conv1d(prev, c, 5, padding=2), nn.GroupNorm(8, c), nn.Mish()))
            self.films.append(nn.Linear(cond_dim, 2 * c))
            prev = c
        self.out = nn.Conv1d(prev, action_dim, 1)

    def encode(self, obs):
        B, T = obs["lowdim"].shape[:2]
        feats = [enc(obs[c].flatten(0, 1)).view(B, T, -1) for enc, c in zip(self.rgb_enc, RGB_KEYS)]
        return torch.cat(feats + [obs["lowdim"]], -1).flatten(1)

    def forward(self, noisy, t, obs):
        cond = torch.cat([self.encode(obs), self.t_emb(t.float().unsqueeze(-1) / 100.0)], -1)
        x = self.inp(noisy.transpose(1, 2))
        for block, film in zip(self.blocks, self.films):
            scale, shift = film(cond).unsqueeze(-1).chunk(2, 1)
            x = block(x) * (1 + scale) + shift
        return self.out(x).transpose(1, 2)


@torch.no_grad()
def rollout(net, stats, args, device, env, scheduler):
    net.eval()
    lo_a, hi_a = (torch.as_tensor(stats[k], device=device) for k in ("action_min", "action_max"))
    lo_o, hi_o = stats["lowdim_min"], stats["lowdim_max"]
    successes = 0
    for ep in range(args.n_rollouts):
        obs = env.reset()
        history = [obs] * args.n_obs_steps
        for _ in range(0, args.max_steps, args.n_action_steps):
            h = history[-args.n_obs_steps:]
            # robomimic's env wrapper already returns CHW float images in [0, 1]
            batch = {c: torch.as_tensor(np.stack([o[c] for o in h]), device=device).float()[None] for c in RGB_KEYS}
            lowdim = np.stack([np.concatenate([o[k] for k in LOWDIM_KEYS]) for o in h])
            lowdim = (lowdim - lo_o) / np.maximum(hi_o - lo_o, 1e-6) * 2 - 1
            batch["lowdim"] = torch.as_tensor(lowdim, device=device).float()[None]
            a = torch.randn(1, args.horizon, lo_a.shape[0], device=device)
            for t in scheduler.timesteps:
                a = scheduler.step(net(a, t.to(device).expand(1), batch), t, a).prev_sample
            a = (a[0] + 1) / 2 * (hi_a - lo_a) + lo_a
            start = args.n_obs_steps - 1
            for act in a[start:start + args.n_action_steps].cpu().numpy():
                obs, _, done, _ = env.step(act)
                history.append(obs)
                if done or env.is_success()["task"]:
                    break
            if done or env.is_success()["task"]:
                break
        successes += int(env.is_success()["task"])
    net.train()
    return successes / args.n_rollouts


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 runs simulator rollouts while the others wait in a barrier; give it room
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    demos = load_demos(args.dataset)
    stats_path = os.path.join(args.run_dir, "normalizer.npz")
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        if not os.path.exists(stats_path):
            np.savez(stats_path, **fit_minmax(demos))
    dist.barrier()
    stats = dict(np.load(stats_path))

    dataset = DemoWindows(demos, stats, args.n_obs_steps, args.horizon)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, persistent_workers=True, drop_last=True)

    net = DenoiseNet(action_dim=stats["action_min"].shape[0], lowdim_dim=stats["lowdim_min"].shape[0],
                     n_obs_steps=args.n_obs_steps).to(device)
    ema_net = copy.deepcopy(net)
    ema = EMAModel(ema_net.parameters(), power=0.75)
    lr = args.base_lr * args.batch_size * world_size / 64
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.95, 0.999), weight_decay=1e-6)
    lr_sched = get_cosine_schedule_with_warmup(optimizer, 500, args.epochs * len(loader))
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
        net.load_state_dict(ckpt["model"])
        ema_net.load_state_dict(ckpt["ema_model"])
        ema.load_state_dict(ckpt["ema"])
        ema.to(device)
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_sched.load_state_dict(ckpt["lr_sched"])
        start_epoch = ckpt["epoch"] + 1
    ddp_net = DDP(net, device_ids=[local_rank], static_graph=True)

    noise_sched = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", prediction_type="epsilon")
    env = None
    if rank == 0:
        env_meta = FileUtils.get_env_metadata_from_dataset(args.dataset)
        ObsUtils.initialize_obs_utils_with_obs_specs({"obs": {"rgb": RGB_KEYS, "low_dim": LOWDIM_KEYS}})
        env = EnvUtils.create_env_from_metadata(env_meta, render=False, render_offscreen=True, use_image_obs=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp_net.train()
        epoch_loss = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            action = batch.pop("action")
            noise = torch.randn_like(action)
            t = torch.randint(0, 100, (action.shape[0],), device=device)
            pred = ddp_net(noise_sched.add_noise(action, noise, t), t, batch)
            loss = F.mse_loss(pred, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lr_sched.step()
            ema.step(net.parameters())
            epoch_loss += torch.stack([loss.detach() * action.shape[0], torch.tensor(float(action.shape[0]), device=device)])
        dist.all_reduce(epoch_loss)

        if rank == 0:
            print(f"epoch {epoch}: loss {(epoch_loss[0] / epoch_loss[1]).item():.5f}")
            ema.copy_to(ema_net.parameters())
            ckpt = {"model": net.state_dict(), "ema_model": ema_net.state_dict(), "ema": ema.state_dict(),
                    "optimizer": optimizer.state_dict(), "lr_sched": lr_sched.state_dict(),
                    "epoch": epoch, "stats": stats}
            torch.save(ckpt, os.path.join(args.run_dir, "latest.ckpt.tmp"))
            os.replace(os.path.join(args.run_dir, "latest.ckpt.tmp"), os.path.join(args.run_dir, "latest.ckpt"))
            if (epoch + 1) % args.rollout_every == 0:
                noise_sched.set_timesteps(100)
                sr = rollout(ema_net, stats, args, device, env, noise_sched)
                print(f"epoch {epoch}: success rate {sr:.2f}")
                torch.save(ckpt, os.path.join(args.run_dir, f"epoch={epoch:04d}-sr={sr:.3f}.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
