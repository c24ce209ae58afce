"""
Class-conditional DiT on ImageNet VAE latents, trained with DDP.

    torchrun --nnodes=1 --nproc_per_node=8 01_dit_imagenet_ddp.py \
        --data-path /datasets/imagenet/train --results-dir /shared/results/dit
"""
import argparse
import logging
import math
import os
from collections import OrderedDict
from copy import deepcopy
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models import AutoencoderKL
from timm.models.vision_transformer import Attention, Mlp, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def sincos_pos_embed(dim, grid):
    coords = np.arange(grid, dtype=np.float32)
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float32) / (dim / 4.0))
    out = np.einsum("m,d->md", coords, omega)
    emb1d = np.concatenate([np.sin(out), np.cos(out)], axis=1)
    emb_h = np.repeat(emb1d, grid, axis=0)
    emb_w = np.tile(emb1d, (grid, 1))
    return np.concatenate([emb_h, emb_w], axis=1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq_dim=256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class LabelEmbedder(nn.Module):
    # one extra row for the "null" class used by classifier-free guidance
    def __init__(self, num_classes, hidden, dropout_prob):
        super().__init__()
        self.table = nn.Embedding(num_classes + 1, hidden)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, y, train):
        if train and self.dropout_prob > 0:
            drop = torch.rand(y.shape[0], device=y.device) < self.dropout_prob
            y = torch.where(drop, torch.full_like(y, self.num_classes), y)
        return self.table(y)


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, num_heads=heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, int(hidden * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        s1, g1, a1, s2, g2, a2 = self.ada(c).chunk(6, dim=1)
        x = x + a1.unsqueeze(1) * self.attn(modulate(self.norm1(x), s1, g1))
        x = x + a2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, g2))
        return x


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, hidden=1152, depth=28, heads=16,
                 class_dropout_prob=0.1, num_classes=1000):
        super().__init__()
        self.in_ch, self.patch = in_ch, patch
        self.x_embedder = PatchEmbed(input_size, patch, in_ch, hidden, bias=True)
        self.t_embedder = TimestepEmbedder(hidden)
        self.y_embedder = LabelEmbedder(num_classes, hidden, class_dropout_prob)
        grid = input_size // patch
        self.pos_embed = nn.Parameter(torch.from_numpy(sincos_pos_embed(hidden, grid)).float().unsqueeze(0),
                                      requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final_linear = nn.Linear(hidden, patch * patch * in_ch)
        for blk in self.blocks:
            nn.init.zeros_(blk.ada[-1].weight)
            nn.init.zeros_(blk.ada[-1].bias)
        nn.init.zeros_(self.final_linear.weight)
        nn.init.zeros_(self.final_linear.bias)

    def unpatchify(self, x):
        p, c = self.patch, self.in_ch
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(t) + self.y_embedder(y, self.training)
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        return self.unpatchify(self.final_linear(modulate(self.final_norm(x), shift, scale)))

    def forward_with_cfg(self, x, t, y, cfg_scale):
        half = x[: len(x) // 2]
        combined = torch.cat([half, half], dim=0)
        eps = self.forward(combined, t, y)
        cond, uncond = eps.chunk(2, dim=0)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([guided, guided], dim=0)


class GaussianDiffusion:
    def __init__(self, timesteps=1000, device="cpu"):
        betas = torch.linspace(1e-4, 0.02, timesteps, dtype=torch.float64)
        self.T = timesteps
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).float().to(device)

    def q_sample(self, x0, t, noise):
        a = self.alphas_cumprod[t].view(-1, 1, 1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def training_loss(self, model, x0, y):
        t = torch.randint(0, self.T, (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        return F.mse_loss(model(self.q_sample(x0, t, noise), t, y), noise)

    @torch.no_grad()
    def ddim_sample(self, fn, shape, device, steps=50, **kw):
        x = torch.randn(shape, device=device)
        ts = torch.linspace(self.T - 1, 0, steps, device=device).long()
        for i, t in enumerate(ts):
            a_t = self.alphas_cumprod[t]
            a_prev = self.alphas_cumprod[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, device=device)
            eps = fn(x, t.expand(shape[0]), **kw)
            x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        return x


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    ema_params = OrderedDict(ema.named_parameters())
    for name, p in model.named_parameters():
        ema_params[name].mul_(decay).add_(p.data, alpha=1 - decay)


def create_logger(logging_dir, rank):
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                            handlers=[logging.StreamHandler(), logging.FileHandler(f"{logging_dir}/log.txt")])
        return logging.getLogger(__name__)
    logger = logging.getLogger(__name__)
    logger.addHandler(logging.NullHandler())
    return logger


@torch.no_grad()
def sample_for_fid(ema, vae, diffusion, args, rank, world, device):
    """Every rank draws the same number of samples; rank 0 receives the whole set."""
    per_rank = math.ceil(args.fid_samples / (world * args.sample_batch)) * args.sample_batch
    ema.eval()
    local = []
    for _ in range(per_rank // args.sample_batch):
        n = args.sample_batch
        y = torch.randint(0, args.num_classes, (n,), device=device)
        y = torch.cat([y, torch.full_like(y, args.num_classes)])
        z = diffusion.ddim_sample(ema.forward_with_cfg, (2 * n, 4, args.image_size // 8, args.image_size // 8),
                                  device, y=y, cfg_scale=args.cfg_scale)[:n]
        img = vae.decode(z / 0.18215).sample
        local.append(((img.clamp(-1, 1) + 1) * 127.5).to(torch.uint8))
    local = torch.cat(local)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if rank == 0:
        allimgs = torch.cat(gathered)[: args.fid_samples].permute(0, 2, 3, 1).cpu().numpy()
        np.savez(os.path.join(args.results_dir, "samples.npz"), arr_0=allimgs)
    dist.barrier()


def main(args):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    assert args.global_batch_size % world == 0
    seed = args.global_seed * world + rank
    torch.manual_seed(seed)

    if rank == 0:
        os.makedirs(args.results_dir, exist_ok=True)
    dist.barrier()
    logger = create_logger(args.results_dir, rank)

    model = DiT(input_size=args.image_size // 8, num_classes=args.num_classes).to(device)
    ema = deepcopy(model).requires_grad_(False)
    vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema").to(device).eval()
    diffusion = GaussianDiffusion(device=device)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    start_step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        start_step = ckpt["step"]
    else:
        update_ema(ema, model, decay=0)
    model = DDP(model, device_ids=[local_rank])
    logger.info(f"DiT parameters: {sum(p.numel() for p in model.parameters()):,}")

    transform = transforms.Compose([
        transforms.Resize(args.image_size), transforms.CenterCrop(args.image_size),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    dataset = ImageFolder(args.data_path, transform=transform)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.global_seed)
    loader = DataLoader(dataset, batch_size=args.global_batch_size // world, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)

    model.train()
    train_steps, running_loss, log_steps, start = start_step, 0.0, 0, time()
    steps_per_epoch = len(loader)
    for epoch in range(start_step // steps_per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                x = vae.encode(x).latent_dist.sample().mul_(0.18215)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = diffusion.training_loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_ema(ema, model.module)

            running_loss += loss.item()
            log_steps += 1
            train_steps += 1
            if train_steps % args.log_every == 0:
                torch.cuda.synchronize()
                avg = torch.tensor(running_loss / log_steps, device=device)
                dist.all_reduce(avg, op=dist.ReduceOp.SUM)
                logger.info(f"step={train_steps:07d} loss={avg.item() / world:.4f} "
                            f"steps/s={log_steps / (time() - start):.2f}")
                running_loss, log_steps, start = 0.0, 0, time()

            if train_steps % args.ckpt_every == 0:
                if rank == 0:
                    ckpt = {"model": model.module.state_dict(), "ema": ema.state_dict(),
                            "opt": opt.state_dict(), "step": train_steps, "args": vars(args)}
                    path = f"{args.results_dir}/{train_steps:07d}.pt"
                    torch.save(ckpt, path)
                    logger.info(f"saved checkpoint to {path}")
                dist.barrier()

            if args.fid_every and train_steps % args.fid_every == 0:
                sample_for_fid(ema, vae, diffusion, args, rank, world, device)
                logger.info(f"wrote {args.fid_samples} samples for FID at step {train_steps}")

    logger.info("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-path", type=str, required=True)
    parser.add_argument("--results-dir", type=str, default="results")
    parser.add_argument("--image-size", type=int, choices=[256, 512], default=256)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=1400)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--global-seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--ckpt-every", type=int, default=50_000)
    parser.add_argument("--fid-every", type=int, default=0)
    parser.add_argument("--fid-samples", type=int, default=10_000)
    parser.add_argument("--sample-batch", type=int, default=32)
    parser.add_argument("--cfg-scale", type=float, default=1.5)
    parser.add_argument("--resume", type=str, default=None)
    main(parser.parse_args())
