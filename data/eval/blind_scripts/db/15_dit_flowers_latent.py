"""
Latent DiT (class-conditional, learned-sigma-free eps model) on CUB / Oxford flowers at 256px.
The SD VAE encodes images on the fly.

torchrun --nproc_per_node=4 15_dit_flowers_latent.py --config configs/dit_s2_flowers.yaml
"""
import argparse
import logging
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models import AutoencoderKL
from omegaconf import OmegaConf
from timm.models.vision_transformer import Attention, Mlp, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger("dit")


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(d, num_heads=heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(d, 4 * d, act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        nn.init.constant_(self.adaLN[-1].weight, 0)
        nn.init.constant_(self.adaLN[-1].bias, 0)

    def forward(self, x, c):
        a, b, g, a2, b2, g2 = self.adaLN(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + g * self.attn(self.norm1(x) * (1 + b) + a)
        return x + g2 * self.mlp(self.norm2(x) * (1 + b2) + a2)


class DiT(nn.Module):
    def __init__(self, input_size, patch, d, depth, heads, num_classes, class_dropout):
        super().__init__()
        self.patch, self.num_classes, self.class_dropout = patch, num_classes, class_dropout
        self.x_embedder = PatchEmbed(input_size, patch, 4, d, bias=True)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.x_embedder.num_patches, d))
        nn.init.normal_(self.pos_embed, std=0.02)
        self.t_embedder = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.y_embedder = nn.Embedding(num_classes + 1, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_adaLN = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.final = nn.Linear(d, patch * patch * 4)
        nn.init.constant_(self.final.weight, 0)
        nn.init.constant_(self.final.bias, 0)

    def forward(self, x, t, y):
        if self.training and self.class_dropout > 0:
            y = torch.where(torch.rand(y.shape, device=y.device) < self.class_dropout,
                            torch.full_like(y, self.num_classes), y)
        freqs = torch.exp(-math.log(10000) * torch.arange(128, device=x.device) / 128)
        tf = torch.cat([torch.cos(t[:, None].float() * freqs), torch.sin(t[:, None].float() * freqs)], -1)
        c = self.t_embedder(tf) + self.y_embedder(y)
        h = self.x_embedder(x) + self.pos_embed
        for blk in self.blocks:
            h = blk(h, c)
        s, sc = self.final_adaLN(c).unsqueeze(1).chunk(2, dim=-1)
        h = self.final(self.final_norm(h) * (1 + sc) + s)
        n = int(h.shape[1] ** 0.5)
        p = self.patch
        h = h.reshape(-1, n, n, p, p, 4).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(-1, 4, n * p, n * p)


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides, key=value")
    return parser.parse_args()


def main():
    args = get_args()
    cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.opts))

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(cfg.seed * world + rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    log.info(OmegaConf.to_yaml(cfg))

    out_dir = cfg.output_dir
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(out_dir, "config.yaml"))

    vae = AutoencoderKL.from_pretrained(cfg.vae).to(device).eval().requires_grad_(False)
    model = DiT(cfg.image_size // 8, cfg.patch, cfg.hidden, cfg.depth, cfg.heads, cfg.num_classes, cfg.class_dropout)
    model = model.to(device)
    ema = deepcopy(model).requires_grad_(False).eval()
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0)
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    abar = torch.cumprod(1 - betas, 0).float().to(device)

    tf = transforms.Compose([transforms.Resize(cfg.image_size), transforms.CenterCrop(cfg.image_size),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(cfg.data_dir, transform=tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    dl = DataLoader(ds, batch_size=cfg.global_batch // world, sampler=sampler, num_workers=cfg.workers,
                    pin_memory=True, drop_last=True)
    log.info(f"{len(ds)} images / {len(ds.classes)} classes, {len(dl)} steps per epoch")

    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic, loss_sum, n = time.time(), torch.zeros((), device=device), 0
        for x, y in dl:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.no_grad():
                z = vae.encode(x).latent_dist.sample() * 0.18215
            t = torch.randint(0, 1000, (z.shape[0],), device=device)
            eps = torch.randn_like(z)
            a = abar[t][:, None, None, None]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16):
                pred = model(a.sqrt() * z + (1 - a).sqrt() * eps, t, y)
            loss = F.mse_loss(pred.float(), eps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e_p, m_p in zip(ema.parameters(), model.module.parameters()):
                    e_p.mul_(cfg.ema_decay).add_(m_p.detach(), alpha=1 - cfg.ema_decay)
            loss_sum += loss.detach()
            n += 1
            step += 1

        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        log.info(f"epoch {epoch} step {step} loss {loss_sum.item() / (n * world):.4f} time {time.time() - tic:.0f}s")

        if (epoch + 1) % cfg.ckpt_every_epochs == 0 or epoch + 1 == cfg.epochs:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                            "epoch": epoch, "step": step, "cfg": OmegaConf.to_container(cfg)},
                           os.path.join(out_dir, f"epoch{epoch + 1:04d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
