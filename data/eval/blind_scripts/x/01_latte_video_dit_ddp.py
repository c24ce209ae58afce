"""
Class-conditional latent video DiT training (UCF-101 / Kinetics style) with plain torchrun DDP.

    torchrun --nnodes=1 --nproc_per_node=8 train_video_dit.py \
        --data-root /data/ucf101_latents --results-dir results/vdit_b2

Latents are pre-extracted with the SD-VAE (4x32x32 per frame, 16 frames).
"""
import argparse
import glob
import logging
import os
from collections import OrderedDict
from copy import deepcopy
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import wandb
from diffusers import AutoencoderKL, DDPMScheduler


#################################################################################
#                                   Model                                       #
#################################################################################

def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(approximate="tanh"),
                                 nn.Linear(int(dim * mlp_ratio), dim))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        sh1, sc1, g1, sh2, sc2, g2 = self.adaLN(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), sh1, sc1)
        x = x + g1.unsqueeze(1) * self.attn(h, h, h, need_weights=False)[0]
        x = x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), sh2, sc2))
        return x


class TimestepEmbedder(nn.Module):
    def __init__(self, dim, freq_dim=256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t):
        half = self.freq_dim // 2
        freqs = torch.exp(-np.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class VideoDiT(nn.Module):
    def __init__(self, in_ch=4, frames=16, size=32, patch=2, dim=768, depth=12, heads=12, num_classes=101):
        super().__init__()
        self.patch, self.in_ch, self.frames = patch, in_ch, frames
        self.x_embed = nn.Conv2d(in_ch, dim, patch, patch)
        n_spatial = (size // patch) ** 2
        self.pos_spatial = nn.Parameter(torch.zeros(1, n_spatial, dim))
        self.pos_temporal = nn.Parameter(torch.zeros(1, frames, dim))
        self.t_embed = TimestepEmbedder(dim)
        # last index is the "null" class used for classifier-free guidance
        self.y_embed = nn.Embedding(num_classes + 1, dim)
        self.num_classes = num_classes
        self.blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, patch * patch * in_ch)
        nn.init.normal_(self.pos_spatial, std=0.02)
        nn.init.normal_(self.pos_temporal, std=0.02)
        for blk in self.blocks:
            nn.init.zeros_(blk.adaLN[-1].weight)
            nn.init.zeros_(blk.adaLN[-1].bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, t, y):
        b, f, c, h, w = x.shape
        x = self.x_embed(rearrange(x, "b f c h w -> (b f) c h w"))
        hp, wp = x.shape[-2:]
        x = rearrange(x, "(b f) d hp wp -> b f (hp wp) d", b=b) + self.pos_spatial.unsqueeze(1)
        x = x + self.pos_temporal[:, :f].unsqueeze(2)
        x = rearrange(x, "b f n d -> b (f n) d")
        cond = self.t_embed(t) + self.y_embed(y)
        for blk in self.blocks:
            x = blk(x, cond)
        shift, scale = self.final_ada(cond).chunk(2, dim=1)
        x = self.out(modulate(self.final_norm(x), shift, scale))
        x = rearrange(x, "b (f hp wp) (p q c) -> b f c (hp p) (wp q)", f=f, hp=hp, wp=wp,
                      p=self.patch, q=self.patch, c=self.in_ch)
        return x


#################################################################################
#                                Helpers                                        #
#################################################################################

@torch.no_grad()
def update_ema(ema_model, model, decay=0.9999):
    ema_params = OrderedDict(ema_model.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


def requires_grad(model, flag=True):
    for p in model.parameters():
        p.requires_grad = flag


def create_logger(logging_dir, rank):
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
                            handlers=[logging.StreamHandler(), logging.FileHandler(f"{logging_dir}/log.txt")])
        return logging.getLogger(__name__)
    logger = logging.getLogger(__name__)
    logger.addHandler(logging.NullHandler())
    return logger


class VideoLatentDataset(Dataset):
    """Each .npz holds `latent` [F, 4, 32, 32] (already scaled by 0.18215) and `label`."""

    def __init__(self, root, frames):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.npz"), recursive=True))
        self.frames = frames

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        d = np.load(self.files[idx])
        lat = d["latent"]
        start = np.random.randint(0, lat.shape[0] - self.frames + 1)
        lat = torch.from_numpy(lat[start:start + self.frames]).float()
        if np.random.rand() < 0.5:
            lat = lat.flip(-1)
        return lat, int(d["label"])


#################################################################################
#                                Training                                       #
#################################################################################

def main(args):
    assert torch.cuda.is_available()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    assert args.global_batch_size % world_size == 0
    seed = args.global_seed * world_size + rank
    torch.manual_seed(seed)
    np.random.seed(seed)

    exp_dir = os.path.join(args.results_dir, args.exp_name)
    ckpt_dir = os.path.join(exp_dir, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        wandb.init(project="video-dit", name=args.exp_name, config=vars(args), dir=exp_dir)
    dist.barrier()
    logger = create_logger(exp_dir, rank)

    model = VideoDiT(frames=args.num_frames, num_classes=args.num_classes,
                     dim=args.hidden, depth=args.depth, heads=args.heads)
    ema = deepcopy(model).to(device)
    requires_grad(ema, False)
    model = DDP(model.to(device), device_ids=[local_rank])
    diffusion = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type="epsilon")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0)

    train_steps = 0
    start_epoch = 0
    if args.resume is not None:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        train_steps = ckpt["step"]
        start_epoch = ckpt["epoch"] + 1
        logger.info(f"Resumed from {args.resume} at step {train_steps}")
    else:
        update_ema(ema, model.module, decay=0)

    dataset = VideoLatentDataset(args.data_root, args.num_frames)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.global_seed)
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True, persistent_workers=True)
    logger.info(f"Dataset contains {len(dataset):,} clips, {len(loader)} steps/epoch per rank")

    vae = None
    if rank == 0 and args.sample_every > 0:
        vae = AutoencoderKL.from_pretrained(args.vae_path).to(device).eval()

    model.train()
    ema.eval()
    log_steps, running_loss = 0, 0.0
    start_time = time()
    alphas_cumprod = diffusion.alphas_cumprod.to(device)

    for epoch in range(start_epoch, args.epochs):
        logger.info(f"Beginning epoch {epoch}...")
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            # classifier-free guidance: drop labels to the null class
            drop = torch.rand(y.shape[0], device=device) < args.class_dropout
            y = torch.where(drop, torch.full_like(y, args.num_classes), y)

            t = torch.randint(0, diffusion.config.num_train_timesteps, (x.shape[0],), device=device)
            noise = torch.randn_like(x)
            a = alphas_cumprod[t].view(-1, 1, 1, 1, 1)
            x_t = a.sqrt() * x + (1 - a).sqrt() * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x_t, t, y)
            loss = F.mse_loss(pred.float(), noise)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            update_ema(ema, model.module, decay=args.ema_decay)

            running_loss += loss.item()
            log_steps += 1
            train_steps += 1

            if train_steps % args.log_every == 0:
                torch.cuda.synchronize()
                steps_per_sec = log_steps / (time() - start_time)
                avg_loss = torch.tensor(running_loss / log_steps, device=device)
                dist.all_reduce(avg_loss, op=dist.ReduceOp.SUM)
                avg_loss = avg_loss.item() / world_size
                logger.info(f"(step={train_steps:07d}) Train Loss: {avg_loss:.4f}, Train Steps/Sec: {steps_per_sec:.2f}")
                if rank == 0:
                    wandb.log({"train/loss": avg_loss, "train/steps_per_sec": steps_per_sec, "epoch": epoch},
                              step=train_steps)
                running_loss, log_steps = 0.0, 0
                start_time = time()

            if train_steps % args.ckpt_every == 0:
                if rank == 0:
                    checkpoint = {
                        "model": model.module.state_dict(),
                        "ema": ema.state_dict(),
                        "opt": opt.state_dict(),
                        "args": vars(args),
                        "step": train_steps,
                        "epoch": epoch,
                    }
                    path = f"{ckpt_dir}/{train_steps:07d}.pt"
                    torch.save(checkpoint, path)
                    logger.info(f"Saved checkpoint to {path}")
                dist.barrier()

            if vae is not None and train_steps % args.sample_every == 0:
                sample_and_log(ema, vae, diffusion, args, device, train_steps)

    logger.info("Done!")
    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


@torch.no_grad()
def sample_and_log(ema, vae, diffusion, args, device, step):
    """DDIM-ish ancestral sampling with CFG on the EMA weights. Rank 0 only, no collectives."""
    n = 4
    y = torch.randint(0, args.num_classes, (n,), device=device)
    y_null = torch.full_like(y, args.num_classes)
    x = torch.randn(n, args.num_frames, 4, 32, 32, device=device)
    diffusion.set_timesteps(args.sample_steps)
    for t in diffusion.timesteps:
        tt = torch.full((n,), int(t), device=device, dtype=torch.long)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eps = ema(torch.cat([x, x]), torch.cat([tt, tt]), torch.cat([y, y_null])).float()
        cond, uncond = eps.chunk(2)
        eps = uncond + args.cfg_scale * (cond - uncond)
        x = diffusion.step(eps, t, x).prev_sample
    frames = vae.decode(rearrange(x, "b f c h w -> (b f) c h w") / 0.18215).sample
    frames = rearrange(frames, "(b f) c h w -> b f c h w", b=n)
    frames = ((frames.clamp(-1, 1) + 1) * 127.5).to(torch.uint8).cpu().numpy()
    wandb.log({"samples": [wandb.Video(v, fps=8, format="mp4") for v in frames]}, step=step)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-root", type=str, required=True)
    parser.add_argument("--results-dir", type=str, default="results")
    parser.add_argument("--exp-name", type=str, default="vdit-b2-ucf")
    parser.add_argument("--vae-path", type=str, default="stabilityai/sd-vae-ft-ema")
    parser.add_argument("--num-classes", type=int, default=101)
    parser.add_argument("--num-frames", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=1400)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--global-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--ema-decay", type=float, default=0.9999)
    parser.add_argument("--class-dropout", type=float, default=0.1)
    parser.add_argument("--cfg-scale", type=float, default=4.0)
    parser.add_argument("--sample-steps", type=int, default=50)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--ckpt-every", type=int, default=10_000)
    parser.add_argument("--sample-every", type=int, default=5_000)
    parser.add_argument("--resume", type=str, default=None)
    args = parser.parse_args()
    main(args)
