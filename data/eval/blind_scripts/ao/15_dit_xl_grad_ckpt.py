"""
DiT-XL/2 at 512px (64x64x4 latents) -- needs activation checkpointing to fit a
useful per-GPU batch on 40GB cards.

    torchrun --nnodes=1 --nproc_per_node=8 train_dit_xl.py --feature-path /data/in1k_512_features --results results_xl512
"""
import argparse
import copy
import glob
import logging
import math
import os
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from timm.models.vision_transformer import Attention, Mlp, PatchEmbed


def modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, num_heads=heads, qkv_bias=True, fused_attn=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden, 4 * hidden, act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        nn.init.zeros_(self.adaLN[-1].weight)
        nn.init.zeros_(self.adaLN[-1].bias)

    def forward(self, x, c):
        sm, scm, gm, sf, scf, gf = self.adaLN(c).chunk(6, dim=1)
        x = x + gm[:, None] * self.attn(modulate(self.norm1(x), sm, scm))
        x = x + gf[:, None] * self.mlp(modulate(self.norm2(x), sf, scf))
        return x


class DiT(nn.Module):
    def __init__(self, input_size=64, patch=2, in_ch=4, hidden=1152, depth=28, heads=16, num_classes=1000,
                 grad_ckpt=True):
        super().__init__()
        self.in_ch, self.out_ch, self.patch, self.num_classes = in_ch, in_ch * 2, patch, num_classes
        self.grad_ckpt = grad_ckpt
        self.x_embedder = PatchEmbed(input_size, patch, in_ch, hidden, bias=True)
        self.t_embedder = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.y_embedder = nn.Embedding(num_classes + 1, hidden)
        self.pos_embed = nn.Parameter(self._sincos(hidden, input_size // patch), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final = nn.Linear(hidden, patch * patch * self.out_ch)
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)
        nn.init.normal_(self.y_embedder.weight, std=0.02)

    @staticmethod
    def _sincos(dim, n):
        gy, gx = np.meshgrid(np.arange(n, dtype=np.float32), np.arange(n, dtype=np.float32), indexing="ij")
        omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))
        emb = [np.sin(np.outer(g.reshape(-1), omega)) for g in (gy, gx)] + \
              [np.cos(np.outer(g.reshape(-1), omega)) for g in (gy, gx)]
        return torch.from_numpy(np.concatenate(emb, axis=1)).float()[None]

    @staticmethod
    def t_embed(t, dim=256):
        half = dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        a = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(a), torch.sin(a)], -1)

    def forward(self, x, t, y):
        x = self.x_embedder(x) + self.pos_embed
        c = self.t_embedder(self.t_embed(t)) + self.y_embedder(y)
        for block in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(block, x, c)
            else:
                x = block(x, c)
        shift, scale = self.final_adaLN(c).chunk(2, dim=1)
        x = self.final(modulate(self.final_norm(x), shift, scale))
        p, C = self.patch, self.out_ch
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], h, w, p, p, C).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(x.shape[0], C, h * p, w * p)


class FeatureDataset(Dataset):
    def __init__(self, root):
        self.feats = sorted(glob.glob(os.path.join(root, "imagenet512_features", "*.npy")))
        self.labels = sorted(glob.glob(os.path.join(root, "imagenet512_labels", "*.npy")))
        assert len(self.feats) == len(self.labels)

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return torch.from_numpy(np.load(self.feats[i])), torch.from_numpy(np.load(self.labels[i]))


def get_betas(T=1000):
    return np.linspace(1e-4, 0.02, T, dtype=np.float64)


def create_logger(rank, logging_dir):
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="[\033[34m%(asctime)s\033[0m] %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S",
                            handlers=[logging.StreamHandler(), logging.FileHandler(f"{logging_dir}/log.txt")])
        return logging.getLogger(__name__)
    logger = logging.getLogger(__name__)
    logger.addHandler(logging.NullHandler())
    return logger


@torch.no_grad()
def update_ema(ema_model, model, decay=0.9999):
    ema_params = dict(ema_model.named_parameters())
    for name, param in model.named_parameters():
        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


def main(args):
    assert torch.cuda.is_available()
    device = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    assert args.global_batch_size % world == 0
    torch.manual_seed(args.global_seed * world + rank)

    exp_dir = os.path.join(args.results, "DiT-XL-2-512")
    ckpt_dir = os.path.join(exp_dir, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    logger = create_logger(rank, exp_dir)

    model = DiT(grad_ckpt=not args.no_grad_ckpt)
    ema = copy.deepcopy(model).to(device)
    ema.requires_grad_(False)
    model = DDP(model.to(device), device_ids=[device], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    logger.info(f"DiT params: {sum(p.numel() for p in model.parameters()):,}")

    betas = torch.tensor(get_betas(), device=device, dtype=torch.float32)
    abar = torch.cumprod(1 - betas, 0)
    ds = FeatureDataset(args.feature_path)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.global_seed)
    loader = DataLoader(ds, batch_size=args.global_batch_size // world, shuffle=False, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)
    logger.info(f"Dataset contains {len(ds):,} images")

    update_ema(ema, model.module, decay=0)
    model.train()
    ema.eval()

    train_steps, log_steps, running_loss = 0, 0, 0
    start_time = time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device).squeeze(1)
            y = y.to(device).squeeze(1)
            y = torch.where(torch.rand(y.shape, device=device) < args.class_dropout, torch.full_like(y, 1000), y)
            t = torch.randint(0, 1000, (x.shape[0],), device=device)
            noise = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(a.sqrt() * x + (1 - a).sqrt() * noise, t, y)
            eps, _ = out.float().chunk(2, dim=1)  # learned sigma channels trained with VLB in the full version
            loss = F.mse_loss(eps, noise)
            opt.zero_grad()
            loss.backward()
            opt.step()
            update_ema(ema, model.module)

            running_loss += loss.item()
            log_steps += 1
            train_steps += 1
            if train_steps % args.log_every == 0:
                torch.cuda.synchronize()
                steps_per_sec = log_steps / (time() - start_time)
                avg_loss = torch.tensor(running_loss / log_steps, device=device)
                dist.all_reduce(avg_loss, op=dist.ReduceOp.SUM)
                avg_loss = avg_loss.item() / world
                logger.info(f"(step={train_steps:07d}) Train Loss: {avg_loss:.4f}, Train Steps/Sec: {steps_per_sec:.2f}")
                running_loss, log_steps = 0, 0
                start_time = time()

            if train_steps % args.ckpt_every == 0 and train_steps > 0:
                if rank == 0:
                    checkpoint_path = f"{ckpt_dir}/{train_steps:07d}.pt"
                    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "args": args}, checkpoint_path)
                    logger.info(f"Saved checkpoint to {checkpoint_path}")
                dist.barrier()

    model.eval()
    logger.info("Done!")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--feature-path", type=str, required=True)
    parser.add_argument("--results", type=str, default="results")
    parser.add_argument("--epochs", type=int, default=1400)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--global-seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--ckpt-every", type=int, default=50_000)
    parser.add_argument("--class-dropout", type=float, default=0.1)
    parser.add_argument("--no-grad-ckpt", action="store_true")
    args = parser.parse_args()
    main(args)
