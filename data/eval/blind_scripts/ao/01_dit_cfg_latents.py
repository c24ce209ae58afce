"""
Class-conditional DiT on pre-extracted SD-VAE latents (ImageNet 256 -> 32x32x4).
Label dropout for classifier-free guidance is done by swapping the label for the
extra "null" class, so the embedding table always gets used.

    torchrun --nproc_per_node=8 train_dit.py --latent-dir /data/in1k_latents --results-dir runs
"""
import argparse
import copy
import logging
import math
import os
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image
from diffusers.models import AutoencoderKL
from timm.models.vision_transformer import Attention, Mlp, PatchEmbed


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden, freq_dim=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.freq_dim = freq_dim

    def forward(self, t):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes, hidden, dropout_prob):
        super().__init__()
        # last row is the unconditional / null label
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
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=1)
        x = x + g1.unsqueeze(1) * self.attn(modulate(self.norm1(x), s1, sc1))
        x = x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, sc2))
        return x


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, hidden=768, depth=12, heads=12,
                 num_classes=1000, class_dropout=0.1):
        super().__init__()
        self.in_ch, self.patch = in_ch, patch
        self.x_emb = PatchEmbed(input_size, patch, in_ch, hidden, bias=True)
        self.t_emb = TimestepEmbedder(hidden)
        self.y_emb = LabelEmbedder(num_classes, hidden, class_dropout)
        n = self.x_emb.num_patches
        self.pos = nn.Parameter(torch.zeros(1, n, hidden), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final = nn.Linear(hidden, patch * patch * in_ch)
        nn.init.normal_(self.pos, std=0.02)
        for b in self.blocks:
            nn.init.zeros_(b.ada[-1].weight)
            nn.init.zeros_(b.ada[-1].bias)
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)

    def unpatchify(self, x):
        p, c = self.patch, self.in_ch
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x, t, y):
        x = self.x_emb(x) + self.pos
        c = self.t_emb(t) + self.y_emb(y, self.training)
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        x = self.final(modulate(self.final_norm(x), shift, scale))
        return self.unpatchify(x)

    @torch.no_grad()
    def forward_with_cfg(self, x, t, y, cfg_scale):
        half = x[: len(x) // 2]
        combined = torch.cat([half, half], dim=0)
        out = self.forward(combined, t, y)
        cond, uncond = out.chunk(2, dim=0)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([guided, guided], dim=0)


class LatentDataset(Dataset):
    def __init__(self, root):
        self.latents = np.load(os.path.join(root, "latents.npy"), mmap_mode="r")
        self.labels = np.load(os.path.join(root, "labels.npy"))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        z = torch.from_numpy(np.array(self.latents[i], dtype=np.float32))
        if torch.rand(()) < 0.5:
            z = z.flip(-1)
        return z, int(self.labels[i])


def linear_betas(T=1000):
    return torch.linspace(1e-4, 0.02, T, dtype=torch.float64)


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    ema_p = OrderedDict(ema.named_parameters())
    for name, p in model.named_parameters():
        ema_p[name].mul_(decay).add_(p.data, alpha=1 - decay)


@torch.no_grad()
def ddim_sample(net, shape, labels, alphas_cumprod, cfg_scale, steps=50):
    device = labels.device
    x = torch.randn(shape, device=device)
    x = torch.cat([x, x], 0)
    y = torch.cat([labels, torch.full_like(labels, net.y_emb.num_classes)], 0)
    ts = torch.linspace(len(alphas_cumprod) - 1, 0, steps, device=device).long()
    for i, t in enumerate(ts):
        a_t = alphas_cumprod[t]
        a_prev = alphas_cumprod[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, device=device)
        eps = net.forward_with_cfg(x, t.repeat(len(x)), y, cfg_scale)
        x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x[: len(labels)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--latent-dir", required=True)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=20000)
    p.add_argument("--sample-every", type=int, default=5000)
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--resume", default=None)
    p.add_argument("--global-seed", type=int, default=0)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch_size % world == 0
    torch.manual_seed(args.global_seed * world + rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s] %(message)s")
    log = logging.getLogger("dit")
    if rank == 0:
        os.makedirs(os.path.join(args.results_dir, "checkpoints"), exist_ok=True)
        os.makedirs(os.path.join(args.results_dir, "samples"), exist_ok=True)

    model = DiT().to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0)
    train_steps = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        train_steps = ckpt["step"]
    model = DDP(model, device_ids=[local_rank])
    if not args.resume:
        update_ema(ema, model.module, decay=0)  # start EMA from the broadcast weights
    ema.eval()

    betas = linear_betas().to(device)
    alphas_cumprod = torch.cumprod(1 - betas, 0).float()

    ds = LatentDataset(args.latent_dir)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.global_seed)
    loader = DataLoader(ds, batch_size=args.global_batch_size // world, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)
    log.info(f"{len(ds):,} latents, {sum(p.numel() for p in model.parameters()):,} params")

    vae = None
    if rank == 0:
        vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema").to(device).eval()

    start_epoch = train_steps // len(loader)
    running, n_log, t0 = 0.0, 0, time.time()
    model.train()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for z, y in loader:
            z = z.to(device, non_blocking=True) * 0.18215
            y = y.to(device, non_blocking=True)
            t = torch.randint(0, len(betas), (z.shape[0],), device=device)
            noise = torch.randn_like(z)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            zt = a.sqrt() * z + (1 - a).sqrt() * noise
            loss = F.mse_loss(model(zt, t, y), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_ema(ema, model.module)

            running += loss.item()
            n_log += 1
            train_steps += 1
            if train_steps % args.log_every == 0:
                torch.cuda.synchronize()
                avg = torch.tensor(running / n_log, device=device)
                dist.all_reduce(avg, op=dist.ReduceOp.SUM)
                avg = avg.item() / world
                sps = n_log / (time.time() - t0)
                log.info(f"step {train_steps:07d} loss {avg:.4f} steps/s {sps:.2f}")
                running, n_log, t0 = 0.0, 0, time.time()

            if train_steps % args.sample_every == 0 and rank == 0:
                labels = torch.tensor([207, 360, 387, 974, 88, 979, 417, 279], device=device)
                lat = ddim_sample(ema, (len(labels), 4, 32, 32), labels, alphas_cumprod, args.cfg_scale)
                img = vae.decode(lat / 0.18215).sample
                save_image(img, os.path.join(args.results_dir, "samples", f"{train_steps:07d}.png"),
                           nrow=4, normalize=True, value_range=(-1, 1))

            if train_steps % args.ckpt_every == 0:
                if rank == 0:
                    ckpt = {"model": model.module.state_dict(), "ema": ema.state_dict(),
                            "opt": opt.state_dict(), "step": train_steps, "args": vars(args)}
                    path = os.path.join(args.results_dir, "checkpoints", f"{train_steps:07d}.pt")
                    torch.save(ckpt, path)
                    log.info(f"saved {path}")
                dist.barrier()

    log.info("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
