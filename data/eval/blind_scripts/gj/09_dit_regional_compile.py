"""Class-conditional DiT-B/2 on pre-extracted SD-VAE latents (ImageNet 256).

Regional compilation: each DiT block is compiled in place before DDP wraps
the model, which keeps the compile at a couple of minutes for 12-28 blocks.

    torchrun --nnodes=1 --nproc_per_node=8 dit_regional_compile.py \
        --latents /data/in1k_latents_256 --results /shared/dit_runs --wandb-project dit
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
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, int(hidden * mlp_ratio)), nn.GELU(approximate="tanh"),
                                 nn.Linear(int(hidden * mlp_ratio), hidden))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        s_msa, sc_msa, g_msa, s_mlp, sc_mlp, g_mlp = self.adaLN(c).chunk(6, dim=1)
        h = modulate(self.norm1(x), s_msa, sc_msa)
        x = x + g_msa.unsqueeze(1) * self.attn(h, h, h, need_weights=False)[0]
        return x + g_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s_mlp, sc_mlp))


class DiT(nn.Module):
    def __init__(self, input_size=32, patch=2, in_ch=4, hidden=768, depth=12, heads=12, num_classes=1000):
        super().__init__()
        self.patch, self.in_ch = patch, in_ch
        self.grid = input_size // patch
        self.x_embed = nn.Conv2d(in_ch, hidden, patch, stride=patch)
        self.t_embed = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.y_embed = nn.Embedding(num_classes + 1, hidden)  # last row is the "null" class for CFG
        self.num_classes = num_classes
        self.pos = nn.Parameter(torch.zeros(1, self.grid ** 2, hidden), requires_grad=False)
        self.blocks = nn.ModuleList([DiTBlock(hidden, heads) for _ in range(depth)])
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final = nn.Linear(hidden, patch * patch * in_ch)
        for blk in self.blocks:
            nn.init.zeros_(blk.adaLN[-1].weight)
            nn.init.zeros_(blk.adaLN[-1].bias)
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)

    def unpatchify(self, x):
        B = x.shape[0]
        x = x.view(B, self.grid, self.grid, self.patch, self.patch, self.in_ch)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(B, self.in_ch, self.grid * self.patch, self.grid * self.patch)

    def forward(self, x, t, y):
        x = self.x_embed(x).flatten(2).transpose(1, 2) + self.pos
        c = self.t_embed(timestep_embedding(t, 256)) + self.y_embed(y)
        for blk in self.blocks:
            x = blk(x, c)
        shift, scale = self.final_adaLN(c).chunk(2, dim=1)
        return self.unpatchify(self.final(modulate(self.final_norm(x), shift, scale)))


class LatentDataset(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.npz")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        lat = torch.from_numpy(d["latent"])
        if torch.rand(()) < 0.5:
            lat = lat.flip(-1)
        return lat, int(d["label"])


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    ema_p = dict(ema.named_parameters())
    for name, p in model.named_parameters():
        ema_p[name].mul_(decay).add_(p.detach(), alpha=1 - decay)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--latents", required=True)
    parser.add_argument("--results", required=True)
    parser.add_argument("--wandb-project", default="dit")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=1400)
    parser.add_argument("--ckpt-every", type=int, default=50_000)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--cfg-drop", type=float, default=0.1)
    parser.add_argument("--T", type=int, default=1000)
    parser.add_argument("--global-seed", type=int, default=0)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    assert args.global_batch % world == 0
    torch.manual_seed(args.global_seed * world + rank)  # different noise / cfg drops per rank

    run = wandb.init(project=args.wandb_project, config=vars(args), name=f"DiT-B2-gb{args.global_batch}")
    if rank == 0:
        os.makedirs(os.path.join(args.results, "checkpoints"), exist_ok=True)

    model = DiT().to(device)
    ema = deepcopy(model).requires_grad_(False)
    for blk in model.blocks:
        blk.compile()
    model = DDP(model, device_ids=[local_rank])
    update_ema(ema, model.module, decay=0)  # DDP broadcast rank 0's init; start the EMA from it
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0)

    betas = torch.linspace(1e-4, 0.02, args.T, dtype=torch.float64)
    alphas_bar = torch.cumprod(1 - betas, 0).float().to(device)

    ds = LatentDataset(args.latents)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.global_batch // world, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    train_steps, running, t0 = 0, torch.zeros((), device=device), time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(device, non_blocking=True) * 0.18215
            y = y.to(device, non_blocking=True)
            y = torch.where(torch.rand(y.shape, device=device) < args.cfg_drop, torch.full_like(y, 1000), y)
            t = torch.randint(0, args.T, (x.shape[0],), device=device)
            noise = torch.randn_like(x)
            ab = alphas_bar[t].view(-1, 1, 1, 1)
            x_t = ab.sqrt() * x + (1 - ab).sqrt() * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x_t, t, y)
            loss = (pred.float() - noise).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_ema(ema, model.module)

            running += loss.detach()
            train_steps += 1
            if train_steps % args.log_every == 0:
                torch.cuda.synchronize()
                steps_per_sec = args.log_every / (time() - t0)
                avg = running / args.log_every
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"(step={train_steps:07d}) loss {avg.item():.4f} steps/s {steps_per_sec:.2f}", flush=True)
                    run.log({"train/loss": avg.item(), "train/steps_per_sec": steps_per_sec,
                             "train/epoch": epoch}, step=train_steps)
                running.zero_()
                t0 = time()

            if train_steps % args.ckpt_every == 0:
                if rank == 0:
                    ckpt = {"model": model.module.state_dict(), "ema": ema.state_dict(),
                            "opt": opt.state_dict(), "args": vars(args), "step": train_steps}
                    path = os.path.join(args.results, "checkpoints", f"{train_steps:07d}.pt")
                    torch.save(ckpt, path)
                    print(f"saved {path}", flush=True)
                dist.barrier()

    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
