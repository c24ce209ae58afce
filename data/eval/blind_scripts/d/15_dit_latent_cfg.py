"""
Class-conditional latent diffusion transformer (small DiT) trained on pre-encoded SD-VAE latents
(ImageNet 256 -> 32x32x4 latents stored as .npy shards), with classifier-free guidance training.

torchrun --nproc_per_node=8 15_dit_latent_cfg.py --latents /data/in1k_latents --global-batch 256
"""
import argparse
import glob
import math
import os
from copy import deepcopy
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


# ---------------------------------------------------------------- model
def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


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


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, int(hidden * mlp_ratio)), nn.GELU(approximate="tanh"),
                                 nn.Linear(int(hidden * mlp_ratio), hidden))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), s1, sc1)
        x = x + g1.unsqueeze(1) * self.attn(h, h, h, need_weights=False)[0]
        x = x + g2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, sc2))
        return x


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, hidden=768, depth=12, heads=12, num_classes=1000):
        super().__init__()
        self.patch, self.in_ch = patch, in_ch
        self.x_embed = nn.Conv2d(in_ch, hidden, patch, patch)
        n = (input_size // patch) ** 2
        self.pos = nn.Parameter(torch.zeros(1, n, hidden))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.t_embed = TimestepEmbedder(hidden)
        self.y_embed = nn.Embedding(num_classes, hidden)
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.out = nn.Linear(hidden, patch * patch * in_ch)
        for blk in self.blocks:
            nn.init.zeros_(blk.ada[-1].weight)
            nn.init.zeros_(blk.ada[-1].bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def unpatchify(self, x, hw):
        p, c = self.patch, self.in_ch
        h = w = hw // p
        x = x.reshape(x.size(0), h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.size(0), c, h * p, w * p)

    def forward(self, x, t, y=None):
        hw = x.size(-1)
        x = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_embed(t)
        if y is not None:
            c = c + self.y_embed(y)
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        x = self.out(modulate(self.final_norm(x), shift, scale))
        return self.unpatchify(x, hw)


# ---------------------------------------------------------------- data / diffusion
class LatentShards(Dataset):
    def __init__(self, root):
        self.lat = np.concatenate([np.load(f, mmap_mode="r") for f in sorted(glob.glob(f"{root}/latents_*.npy"))])
        self.lab = np.concatenate([np.load(f) for f in sorted(glob.glob(f"{root}/labels_*.npy"))])

    def __len__(self):
        return len(self.lab)

    def __getitem__(self, i):
        x = torch.from_numpy(np.array(self.lat[i], dtype=np.float32))
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, int(self.lab[i])


def linear_alphas_cumprod(T=1000):
    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    return torch.cumprod(1 - betas, 0).float()


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--results", default="results/dit_b2")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=400_000)
    ap.add_argument("--uncond-prob", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0
    micro = args.global_batch // world
    torch.manual_seed(args.seed * world + rank)

    model = DiT().to(device)
    ema = deepcopy(model).requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0)
    alphas_cumprod = linear_alphas_cumprod().to(device)

    ds = LatentShards(args.latents)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=micro, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    writer = SummaryWriter(args.results) if rank == 0 else None
    if rank == 0:
        os.makedirs(f"{args.results}/checkpoints", exist_ok=True)
        print(f"DiT params: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M, {len(ds)} latents")

    step, epoch = 0, 0
    running, t0 = torch.zeros(1, device=device), time()
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True) * 0.18215
            y = y.to(device, non_blocking=True)
            t = torch.randint(0, 1000, (x.size(0),), device=device)
            noise = torch.randn_like(x)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            x_t = a.sqrt() * x + (1 - a).sqrt() * noise

            # classifier-free guidance: train the unconditional branch on some steps
            if torch.rand(()) < args.uncond_prob:
                y = None

            with torch.autocast("cuda", dtype=torch.bfloat16):
                eps = model(x_t, t, y)
            loss = F.mse_loss(eps.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_ema(ema, model.module)
            running += loss.detach()
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(running, op=dist.ReduceOp.SUM)
                avg = running.item() / (args.log_every * world)
                if rank == 0:
                    sps = args.log_every / (time() - t0)
                    print(f"step {step:07d} loss {avg:.4f} {sps:.2f} steps/s", flush=True)
                    writer.add_scalar("loss", avg, step)
                running.zero_()
                t0 = time()

            if step % args.ckpt_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "args": vars(args), "step": step},
                               f"{args.results}/checkpoints/{step:07d}.pt")
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
