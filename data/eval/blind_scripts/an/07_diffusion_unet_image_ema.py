"""Image-conditioned diffusion policy (ResNet18-GN encoder + 1D temporal UNet),
trained on robomimic image datasets with DDP, EMA weights used for rollouts.

    torchrun --nproc_per_node=4 07_diffusion_unet_image_ema.py --hdf5 data/robomimic/can/ph/image_abs.hdf5
"""
import argparse
import contextlib
import copy
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from diffusers import DDIMScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import robomimic.utils.env_utils as EnvUtils
import robomimic.utils.file_utils as FileUtils
import wandb

RGB_KEYS = ["agentview_image", "robot0_eye_in_hand_image"]
LOWDIM_KEYS = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hdf5", required=True)
    p.add_argument("--out", default="outputs/dp_unet_can")
    p.add_argument("--To", type=int, default=2)
    p.add_argument("--Ta", type=int, default=8)
    p.add_argument("--horizon", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=600)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--train_timesteps", type=int, default=100)
    p.add_argument("--infer_steps", type=int, default=16)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--n_eval", type=int, default=50)
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def compute_minmax(hdf5):
    mins, maxs = [], []
    with h5py.File(hdf5, "r") as f:
        for k in f["data"]:
            a = f[f"data/{k}/actions"][()]
            lo = np.concatenate([f[f"data/{k}/obs/{o}"][()] for o in LOWDIM_KEYS], -1)
            mins.append(np.concatenate([a.min(0), lo.min(0)]))
            maxs.append(np.concatenate([a.max(0), lo.max(0)]))
    return {"min": np.min(mins, 0).astype(np.float32), "max": np.max(maxs, 0).astype(np.float32)}


class ImageSeqDataset(Dataset):
    def __init__(self, hdf5, stats, To, horizon):
        self.f = None
        self.path, self.stats, self.To, self.H = hdf5, stats, To, horizon
        self.index = []
        with h5py.File(hdf5, "r") as f:
            for k in sorted(f["data"].keys()):
                n = f[f"data/{k}"].attrs["num_samples"]
                for t in range(-(To - 1), n - horizon + To):
                    self.index.append((k, t, n))

    def __len__(self):
        return len(self.index)

    def _norm(self, x, sl):
        lo, hi = self.stats["min"][sl], self.stats["max"][sl]
        return (x - lo) / np.maximum(hi - lo, 1e-6) * 2 - 1

    def __getitem__(self, i):
        if self.f is None:  # open lazily so each worker has its own handle
            self.f = h5py.File(self.path, "r")
        k, t, n = self.index[i]
        g = self.f[f"data/{k}"]
        oi = np.clip(np.arange(t, t + self.To), 0, n - 1)
        ai = np.clip(np.arange(t, t + self.H), 0, n - 1)
        act = g["actions"][()][ai].astype(np.float32)
        adim = act.shape[1]
        lowdim = np.concatenate([g[f"obs/{o}"][()][oi] for o in LOWDIM_KEYS], -1).astype(np.float32)
        imgs = np.stack([g[f"obs/{c}"][()][oi] for c in RGB_KEYS], 1)  # To, cams, H, W, 3
        return {
            "img": torch.from_numpy(imgs).permute(0, 1, 4, 2, 3).float() / 255.0,
            "lowdim": torch.from_numpy(self._norm(lowdim, slice(adim, None)).astype(np.float32)),
            "action": torch.from_numpy(self._norm(act, slice(0, adim)).astype(np.float32)),
        }


def resnet18_gn():
    m = torchvision.models.resnet18(weights=None,
                                    norm_layer=lambda c: nn.GroupNorm(num_groups=c // 16, num_channels=c))
    m.fc = nn.Identity()
    return m


class CondResBlock(nn.Module):
    def __init__(self, cin, cout, cond_dim):
        super().__init__()
        self.c1 = nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.c2 = nn.Sequential(nn.Conv1d(cout, cout, 5, padding=2), nn.GroupNorm(8, cout), nn.Mish())
        self.film = nn.Linear(cond_dim, 2 * cout)
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, cond):
        h = self.c1(x)
        scale, bias = self.film(cond).unsqueeze(-1).chunk(2, 1)
        return self.c2(h * scale + bias) + self.skip(x)


class DiffusionUnetImagePolicy(nn.Module):
    def __init__(self, act_dim, lowdim_dim, To, ncam):
        super().__init__()
        self.encoders = nn.ModuleList([resnet18_gn() for _ in range(ncam)])
        cond_dim = To * (512 * ncam + lowdim_dim) + 128
        self.t_mlp = nn.Sequential(nn.Linear(1, 128), nn.Mish(), nn.Linear(128, 128))
        self.down = nn.ModuleList([CondResBlock(act_dim, 256, cond_dim), CondResBlock(256, 512, cond_dim)])
        self.mid = CondResBlock(512, 512, cond_dim)
        self.up = nn.ModuleList([CondResBlock(1024, 256, cond_dim), CondResBlock(512, 256, cond_dim)])
        self.out = nn.Conv1d(256, act_dim, 1)

    def encode_obs(self, img, lowdim):
        b, To = img.shape[:2]
        feats = [enc(img[:, :, c].flatten(0, 1)).view(b, To, -1) for c, enc in enumerate(self.encoders)]
        return torch.cat(feats + [lowdim], -1).flatten(1)

    def denoise(self, noisy, t, obs_cond):
        cond = torch.cat([obs_cond, self.t_mlp(t.float().view(-1, 1) / 100.0)], -1)
        x = noisy.transpose(1, 2)
        skips = []
        for blk in self.down:
            x = blk(x, cond)
            skips.append(x)
        x = self.mid(x, cond)
        for blk in self.up:
            x = blk(torch.cat([x, skips.pop()], 1), cond)
        return self.out(x).transpose(1, 2)

    def forward(self, img, lowdim, noisy_action, t):
        return self.denoise(noisy_action, t, self.encode_obs(img, lowdim))


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for pe, p in zip(ema_model.parameters(), model.parameters()):
        pe.mul_(decay).add_(p.detach(), alpha=1 - decay)


@torch.no_grad()
def rollout_episode(policy, scheduler, env, stats, args, seed, device):
    np.random.seed(seed)
    ob = env.reset()
    hist = [ob] * args.To
    adim = 7
    for _ in range(0, args.max_steps, args.Ta):
        img = torch.from_numpy(np.stack([np.stack([h[c] for c in RGB_KEYS]) for h in hist[-args.To:]]))
        low = np.stack([np.concatenate([h[k] for k in LOWDIM_KEYS]) for h in hist[-args.To:]])
        lo, hi = stats["min"][adim:], stats["max"][adim:]
        low = torch.from_numpy(((low - lo) / np.maximum(hi - lo, 1e-6) * 2 - 1).astype(np.float32))
        cond = policy.encode_obs(img[None].float().to(device), low[None].to(device))
        x = torch.randn(1, args.horizon, adim, device=device)
        scheduler.set_timesteps(args.infer_steps)
        for t in scheduler.timesteps:
            x = scheduler.step(policy.denoise(x, t.view(1).to(device), cond), t, x).prev_sample
        a = (x[0].cpu().numpy() + 1) / 2 * (stats["max"][:adim] - stats["min"][:adim]) + stats["min"][:adim]
        for act in a[args.To - 1:args.To - 1 + args.Ta]:
            ob, _, done, _ = env.step(act)
            hist.append(ob)
            if env.is_success()["task"]:
                return 1.0
            if done:
                return 0.0
    return 0.0


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    # normaliser from the full dataset, computed once and shared
    obj = [compute_minmax(args.hdf5) if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    stats = obj[0]

    ds = ImageSeqDataset(args.hdf5, stats, args.To, args.horizon)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True,
                    persistent_workers=True)

    with h5py.File(args.hdf5, "r") as f:
        adim = f[f"data/{ds.index[0][0]}/actions"].shape[1]
    policy = DiffusionUnetImagePolicy(adim, stats["min"].shape[0] - adim, args.To, len(RGB_KEYS)).to(device)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=1e-6)
    train_sched = DDIMScheduler(num_train_timesteps=args.train_timesteps, beta_schedule="squaredcos_cap_v2",
                                clip_sample=True, prediction_type="epsilon")

    ckpt_path = os.path.join(args.out, "latest.ckpt")
    start_epoch, ckpt = 0, None
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        policy.load_state_dict(ckpt["policy"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch = ckpt["epoch"] + 1

    # DDP broadcasts rank 0's parameters, so the EMA copy is taken afterwards
    model = DDP(policy, device_ids=[local_rank], output_device=local_rank)
    ema_policy = copy.deepcopy(model.module).requires_grad_(False).eval()
    if ckpt is not None:
        ema_policy.load_state_dict(ckpt["ema"])
        del ckpt
    torch.manual_seed(args.seed + rank)  # different diffusion noise on each rank

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="diffusion_policy", name=os.path.basename(args.out), config=vars(args))
        env_meta = FileUtils.get_env_metadata_from_dataset(args.hdf5)
    else:
        env_meta = None
    meta = [env_meta]
    dist.broadcast_object_list(meta, src=0)
    env = EnvUtils.create_env_from_metadata(env_meta=meta[0], render=False, render_offscreen=True,
                                            use_image_obs=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for i, batch in enumerate(dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % args.grad_accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                a = batch["action"]
                noise = torch.randn_like(a)
                t = torch.randint(0, args.train_timesteps, (a.shape[0],), device=device)
                pred = model(batch["img"], batch["lowdim"], train_sched.add_noise(a, noise, t), t)
                loss = F.mse_loss(pred, noise)
                (loss / args.grad_accum).backward()
            if sync_now:
                opt.step()
                opt.zero_grad(set_to_none=True)
                ema_update(ema_policy, model.module, args.ema_decay)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(tot)
        log = {"train/loss": (tot[0] / tot[1]).item(), "epoch": epoch}

        if (epoch + 1) % args.eval_every == 0:
            eval_sched = DDIMScheduler.from_config(train_sched.config)
            results = [rollout_episode(ema_policy, eval_sched, env, stats, args, 50_000 + ep, device)
                       for ep in range(rank, args.n_eval, world)]
            gathered = [None] * world
            dist.all_gather_object(gathered, results)
            flat = [r for rs in gathered for r in rs]
            log["eval/success_rate"] = float(np.mean(flat))

        if rank == 0:
            wandb.log(log)
            torch.save({"policy": model.module.state_dict(), "ema": ema_policy.state_dict(),
                        "opt": opt.state_dict(), "epoch": epoch, "stats": stats}, ckpt_path)
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
