# Class-conditional DiT-B/2 on pre-extracted ImageNet-256 VAE features (fast-DiT layout:
#   <feature_path>/imagenet256_features/*.npy and <feature_path>/imagenet256_labels/*.npy).
# Classifier-free guidance is trained by dropping the class conditioning on a fraction of steps.
#
#   torchrun --nnodes=1 --nproc_per_node=8 04_dit_cfg_train.py --feature-path /data/in256_feats
import argparse
import math
import os
import random
from copy import deepcopy
from glob import glob
from time import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FeatureDataset(Dataset):
    def __init__(self, features_dir, labels_dir):
        self.features = sorted(glob(os.path.join(features_dir, "*.npy")))
        self.labels = sorted(glob(os.path.join(labels_dir, "*.npy")))
        assert len(self.features) == len(self.labels)

    def __len__(self):
        return len(self.features)

    def __getitem__(self, idx):
        x = torch.from_numpy(np.load(self.features[idx])).squeeze(0)
        y = torch.from_numpy(np.load(self.labels[idx])).squeeze(0).long()
        return x, y


def t_embed(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device).float() / half)
    a = t[:, None].float() * freqs[None]
    return torch.cat([a.cos(), a.sin()], -1)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        nn.init.zeros_(self.mod[1].weight)
        nn.init.zeros_(self.mod[1].bias)

    def forward(self, x, c):
        sh1, sc1, g1, sh2, sc2, g2 = self.mod(c)[:, None].chunk(6, dim=-1)
        h = self.ln1(x) * (1 + sc1) + sh1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.ln2(x) * (1 + sc2) + sh2
        return x + g2 * self.mlp(h)


class DiT(nn.Module):
    def __init__(self, in_ch=4, size=32, patch=2, d=768, depth=12, heads=12, num_classes=1000):
        super().__init__()
        self.patch, self.in_ch, self.d = patch, in_ch, d
        self.grid = size // patch
        self.patchify = nn.Conv2d(in_ch, d, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, self.grid * self.grid, d))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.time_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.label_emb = nn.Embedding(num_classes, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.ln_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mod_out = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.out = nn.Linear(d, patch * patch * in_ch)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, t, y=None):
        B = x.shape[0]
        h = self.patchify(x).flatten(2).transpose(1, 2) + self.pos
        c = self.time_mlp(t_embed(t, 256))
        if y is not None:
            c = c + self.label_emb(y)
        for blk in self.blocks:
            h = blk(h, c)
        sh, sc = self.mod_out(c)[:, None].chunk(2, dim=-1)
        h = self.out(self.ln_out(h) * (1 + sc) + sh)
        p, g = self.patch, self.grid
        h = h.view(B, g, g, p, p, self.in_ch).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(B, self.in_ch, g * p, g * p)


def cosine_alphas_cumprod(T, s=0.008):
    steps = torch.arange(T + 1, dtype=torch.float64) / T
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).float()


@torch.no_grad()
def ddim_cfg(model, y, abar, steps=50, scale=4.0, shape=(4, 32, 32)):
    dev = y.device
    x = torch.randn(len(y), *shape, device=dev)
    ts = torch.linspace(len(abar) - 1, 0, steps, device=dev).round().long()
    for i, t in enumerate(ts):
        tt = t.repeat(len(y))
        e_c = model(x, tt, y)
        e_u = model(x, tt, None)
        e = e_u + scale * (e_c - e_u)
        a = abar[t]
        a_prev = abar[ts[i + 1]] if i + 1 < steps else torch.ones((), device=dev)
        x0 = (x - (1 - a).sqrt() * e) / a.sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * e
    return x


def main(args):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    seed = args.global_seed * world + rank
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)

    exp_dir = os.path.join(args.results_dir, args.exp_name)
    ckpt_dir = os.path.join(exp_dir, "checkpoints")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        print(f"experiment dir: {exp_dir}")

    model = DiT(num_classes=args.num_classes).to(device)
    ema = deepcopy(model).requires_grad_(False).eval()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0)
    abar = cosine_alphas_cumprod(args.T).to(device)

    ds = FeatureDataset(os.path.join(args.feature_path, "imagenet256_features"),
                        os.path.join(args.feature_path, "imagenet256_labels"))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.global_seed)
    loader = DataLoader(ds, batch_size=args.global_batch_size // world, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True)
    if rank == 0:
        print(f"{len(ds):,} latents, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")

    step, t_start, loss_acc = 0, time(), torch.zeros((), device=device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if random.random() < args.cond_drop_prob:
                y = None
            t = torch.randint(0, args.T, (x.shape[0],), device=device)
            noise = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x + (1 - a).sqrt() * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, t, y)
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.module.parameters()):
                    pe.mul_(args.ema_decay).add_(pm.detach(), alpha=1 - args.ema_decay)
            loss_acc += loss.detach()
            step += 1

            if step % args.log_every == 0:
                dist.all_reduce(loss_acc)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {loss_acc.item() / (world * args.log_every):.4f} "
                          f"{args.log_every / (time() - t_start):.2f} it/s", flush=True)
                loss_acc.zero_()
                t_start = time()

            if step % args.ckpt_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "args": vars(args), "step": step},
                               os.path.join(ckpt_dir, f"{step:07d}.pt"))
                    ys = torch.arange(8, device=device) * (args.num_classes // 8)
                    z = ddim_cfg(ema, ys, abar, scale=args.cfg_scale)
                    torch.save(z.cpu(), os.path.join(exp_dir, f"preview_{step:07d}.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--feature-path", required=True)
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--exp-name", default="dit_b2_cfg")
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--T", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ema-decay", type=float, default=0.9999)
    ap.add_argument("--cond-drop-prob", type=float, default=0.1)
    ap.add_argument("--cfg-scale", type=float, default=4.0)
    ap.add_argument("--global-seed", type=int, default=0)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=20_000)
    main(ap.parse_args())
