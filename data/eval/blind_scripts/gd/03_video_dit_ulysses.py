# Text-to-video DiT training on pre-encoded VAE latents.
# Sequence parallel (Ulysses all-to-all over heads) inside groups of --sp ranks,
# data parallel across groups.
#
#   torchrun --nproc_per_node=8 03_video_dit_ulysses.py --config configs/dit_xl_256x49.yaml --sp 4
import argparse
import math
import os
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def all_to_all(x, group, scatter_dim, gather_dim):
    n = dist.get_world_size(group)
    xs = [c.contiguous() for c in x.chunk(n, dim=scatter_dim)]
    out = [torch.empty_like(xs[0]) for _ in range(n)]
    dist.all_to_all(out, xs, group=group)
    return torch.cat(out, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, scatter_dim, gather_dim)
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        group, scatter_dim, gather_dim = ctx.args
        return all_to_all(g, group, gather_dim, scatter_dim), None, None, None


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_3d(t, h, w, dim):
    """Fixed 3D sin-cos position table of shape [t*h*w, dim] (dim split 1/4, 3/8, 3/8)."""
    dt, dh = dim // 4, 3 * dim // 8
    dw = dim - dt - dh

    def one(n, d):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2))
        out = np.outer(np.arange(n), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    gt, gh, gw = one(t, dt), one(h, dh), one(w, dw)
    grid = np.concatenate([
        np.repeat(gt, h * w, axis=0),
        np.tile(np.repeat(gh, w, axis=0), (t, 1)),
        np.tile(gw, (t * h, 1)),
    ], axis=1)
    return torch.from_numpy(grid).float()


class DiTBlock(nn.Module):
    def __init__(self, dim, heads, sp_group):
        super().__init__()
        self.heads, self.sp_group = heads, sp_group
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def attn(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.heads, C // self.heads)
        # [B, N/P, 3, H, D] -> [B, N, 3, H/P, D]
        qkv = _AllToAll.apply(qkv, self.sp_group, 3, 1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        o = _AllToAll.apply(o, self.sp_group, 1, 2)
        return self.proj(o.reshape(B, N, C))

    def forward(self, x, c):
        s1, g1, a1, s2, g2, a2 = self.ada(c).chunk(6, dim=-1)
        x = x + a1.unsqueeze(1) * self.attn(modulate(self.norm1(x), s1, g1))
        return x + a2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), s2, g2))


class VideoDiT(nn.Module):
    def __init__(self, cfg, sp_group):
        super().__init__()
        self.patch = cfg["patch"]
        in_dim = cfg["latent_channels"] * self.patch * self.patch
        dim = cfg["hidden"]
        self.x_embed = nn.Linear(in_dim, dim)
        self.t_embed = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.y_embed = nn.Sequential(nn.Linear(cfg["text_dim"], dim), nn.SiLU(), nn.Linear(dim, dim))
        self.null_y = nn.Parameter(torch.zeros(cfg["text_dim"]))
        self.blocks = nn.ModuleList(DiTBlock(dim, cfg["heads"], sp_group) for _ in range(cfg["depth"]))
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.final = nn.Linear(dim, in_dim)
        self.grad_ckpt = cfg.get("grad_checkpointing", True)
        for m in [self.final, self.final_ada[-1]] + [b.ada[-1] for b in self.blocks]:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, tokens, pos, t, y, drop):
        y = torch.where(drop[:, None], self.null_y.expand_as(y), y)
        c = self.t_embed(timestep_embedding(t, 256)) + self.y_embed(y)
        x = self.x_embed(tokens) + pos
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, c, use_reentrant=False)
            else:
                x = blk(x, c)
        shift, scale = self.final_ada(c).chunk(2, dim=-1)
        return self.final(modulate(self.final_norm(x), shift, scale))


def patchify(z, p):
    # z: [B, C, T, H, W] -> [B, T*(H/p)*(W/p), C*p*p]
    B, C, T, H, W = z.shape
    z = z.view(B, C, T, H // p, p, W // p, p).permute(0, 2, 3, 5, 1, 4, 6)
    return z.reshape(B, T * (H // p) * (W // p), C * p * p)


class LatentClips(Dataset):
    def __init__(self, root, index_file):
        with open(index_file) as f:
            self.items = [l.strip() for l in f if l.strip()]
        self.root = root

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = torch.load(os.path.join(self.root, self.items[i]), map_location="cpu")
        return d["latent"].float(), d["text_pooled"].float()


@torch.no_grad()
def update_ema(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--sp", type=int, default=4)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    sp_group = None
    for i in range(0, world, args.sp):
        ranks = list(range(i, i + args.sp))
        g = dist.new_group(ranks)
        if rank in ranks:
            sp_group, sp_leader = g, i
    sp_rank = rank - sp_leader
    dp_rank, dp_size = rank // args.sp, world // args.sp

    torch.manual_seed(cfg["seed"])
    model = VideoDiT(cfg, sp_group).cuda()
    ema = deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    start_step = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        start_step = ck["step"]
    model = DDP(model, device_ids=[local_rank])
    # different noise on every rank from here on
    torch.manual_seed(cfg["seed"] + rank)

    T_lat, H_lat, W_lat = cfg["latent_frames"], cfg["latent_size"], cfg["latent_size"]
    n_tok = T_lat * (H_lat // cfg["patch"]) * (W_lat // cfg["patch"])
    assert n_tok % args.sp == 0 and cfg["heads"] % args.sp == 0
    local = n_tok // args.sp
    pos = sincos_3d(T_lat, H_lat // cfg["patch"], W_lat // cfg["patch"], cfg["hidden"]).cuda()
    pos = pos[sp_rank * local:(sp_rank + 1) * local].unsqueeze(0)

    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alphas_bar = torch.cumprod(1 - betas, 0).float().cuda()

    ds = LatentClips(cfg["latent_root"], cfg["train_index"])
    sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        wandb.init(project="video-dit", config={**cfg, "sp": args.sp, "world": world})

    step = start_step
    epoch = step // len(loader)
    model.train()
    while step < cfg["max_steps"]:
        sampler.set_epoch(epoch)
        for z, y in loader:
            z, y = z.cuda(non_blocking=True), y.cuda(non_blocking=True)
            B = z.size(0)
            x0 = patchify(z * cfg["latent_scale"], cfg["patch"])[:, sp_rank * local:(sp_rank + 1) * local]

            # timestep and CFG drop are per sample, so the shards of one sample must agree
            t = torch.randint(0, 1000, (B,), device="cuda")
            drop = (torch.rand(B, device="cuda") < cfg["cfg_drop"]).long()
            meta = torch.stack([t, drop])
            dist.broadcast(meta, src=sp_leader, group=sp_group)
            t, drop = meta[0], meta[1].bool()

            noise = torch.randn_like(x0)
            ab = alphas_bar[t].view(B, 1, 1)
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, pos, t, y, drop)
            loss = F.mse_loss(pred.float(), noise)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            opt.step()
            update_ema(ema, model.module, cfg["ema_decay"])
            step += 1

            if step % cfg["log_every"] == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "grad_norm": gn.item(), "epoch": epoch}, step=step)

            if step % cfg["ckpt_every"] == 0 or step == cfg["max_steps"]:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "step": step, "cfg": cfg},
                               os.path.join(cfg["out_dir"], f"{step:08d}.pt"))
                dist.barrier()
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
