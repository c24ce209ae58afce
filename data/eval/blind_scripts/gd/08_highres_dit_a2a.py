"""
Class-conditional DiT at 2048x2048 (256x256 latents, patch 2 -> 16384 tokens).
Tokens are sharded across a sequence-parallel group; attention uses
all_to_all_single to switch between sequence and head sharding.

  torchrun --nproc_per_node 8 08_highres_dit_a2a.py --data /nfs/latents/in2k_2048 --sp 8 --results /nfs/results
"""
import argparse
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import DatasetFolder


def seq_to_head(x, group):
    # [B, S/P, H, D] -> [B, S, H/P, D]
    P = dist.get_world_size(group)
    B, s, H, D = x.shape
    x = x.reshape(B, s, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out.permute(1, 0, 2, 3, 4).reshape(B, P * s, H // P, D)


def head_to_seq(x, group):
    # [B, S, H/P, D] -> [B, S/P, H, D]
    P = dist.get_world_size(group)
    B, S, h, D = x.shape
    x = x.reshape(B, P, S // P, h, D).permute(1, 0, 2, 3, 4).contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out.permute(1, 2, 0, 3, 4).reshape(B, S // P, P * h, D)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx, g):
        return head_to_seq(g.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return head_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return seq_to_head(g.contiguous(), ctx.group), None


def get_2d_sincos(dim, grid):
    gh, gw = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32), indexing="ij")

    def emb1d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([emb1d(dim // 2, gh), emb1d(dim // 2, gw)], axis=1)


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, group):
        super().__init__()
        self.heads, self.group = heads, group
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, hidden * 3)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden * 4), nn.GELU(approximate="tanh"), nn.Linear(hidden * 4, hidden))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c):
        sh_msa, sc_msa, g_msa, sh_mlp, sc_mlp, g_mlp = self.adaLN(c).unsqueeze(1).chunk(6, dim=2)
        h = self.norm1(x) * (1 + sc_msa) + sh_msa
        B, N, C = h.shape
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, C // self.heads).unbind(2)
        q, k, v = (SeqToHead.apply(t, self.group).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        a = HeadToSeq.apply(a, self.group).reshape(B, N, C)
        x = x + g_msa * self.proj(a)
        return x + g_mlp * self.mlp(self.norm2(x) * (1 + sc_mlp) + sh_mlp)


class DiT(nn.Module):
    def __init__(self, input_size=256, patch=2, in_ch=4, hidden=1152, depth=28, heads=16, num_classes=1000, group=None):
        super().__init__()
        self.patch, self.in_ch, self.grid = patch, in_ch, input_size // patch
        self.x_embedder = nn.Linear(in_ch * patch * patch, hidden)
        self.t_embedder = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.y_embedder = nn.Embedding(num_classes + 1, hidden)  # last row = unconditional
        self.num_classes = num_classes
        self.register_buffer("pos_embed", torch.from_numpy(get_2d_sincos(hidden, self.grid)).float()[None],
                             persistent=False)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, group) for _ in range(depth))
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final = nn.Linear(hidden, patch * patch * in_ch)
        for blk in self.blocks:
            nn.init.zeros_(blk.adaLN[-1].weight)
            nn.init.zeros_(blk.adaLN[-1].bias)
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)

    def patchify(self, x):
        B, C, H, W = x.shape
        p = self.patch
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (H // p) * (W // p), C * p * p)

    def forward(self, tokens, tok_slice, t, y):
        half = 128
        freqs = torch.exp(-np.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        ang = t[:, None].float() * freqs[None]
        c = self.t_embedder(torch.cat([ang.cos(), ang.sin()], -1)) + self.y_embedder(y)
        x = self.x_embedder(tokens) + self.pos_embed[:, tok_slice]
        for blk in self.blocks:
            x = blk(x, c)
        sh, sc = self.final_ada(c).unsqueeze(1).chunk(2, dim=2)
        return self.final(self.final_norm(x) * (1 + sc) + sh)


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    ema_p = OrderedDict(ema.named_parameters())
    for name, p in model.named_parameters():
        ema_p[name].mul_(decay).add_(p.data, alpha=1 - decay)


def npy_loader(path):
    return torch.from_numpy(np.load(path))


def main(args):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(device)
    assert world % args.sp == 0

    groups = [dist.new_group(list(range(i, i + args.sp))) for i in range(0, world, args.sp)]
    sp_group = groups[rank // args.sp]
    sp_rank, leader = rank % args.sp, (rank // args.sp) * args.sp
    dp_rank, dp_size = rank // args.sp, world // args.sp

    if rank == 0:
        os.makedirs(args.results, exist_ok=True)
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                            handlers=[logging.StreamHandler(), logging.FileHandler(f"{args.results}/log.txt")])
    logger = logging.getLogger(__name__)

    torch.manual_seed(args.seed)
    model = DiT(input_size=args.latent_size, group=sp_group).to(device)
    ema = deepcopy(model).requires_grad_(False)
    model = DDP(model, device_ids=[device])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    torch.manual_seed(args.seed * world + rank)

    n_tok = (args.latent_size // 2) ** 2
    local = n_tok // args.sp
    tok_slice = slice(sp_rank * local, (sp_rank + 1) * local)
    alphas_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0).float().to(device)

    dataset = DatasetFolder(args.data, loader=npy_loader, extensions=(".npy",))
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True)
    if rank == 0:
        logger.info(f"DiT params {sum(p.numel() for p in model.parameters()):,}, {len(dataset):,} latents, "
                    f"sp={args.sp} dp={dp_size}")

    model.train()
    train_steps, running, log_steps, start = 0, 0.0, 0, time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for lat, y in loader:
            lat, y = lat.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x0 = model.patchify(lat * 0.18215)[:, tok_slice]
            t = torch.randint(0, 1000, (lat.size(0),), device=device)
            y = torch.where(torch.rand(y.shape, device=device) < 0.1, torch.full_like(y, 1000), y)
            ty = torch.stack([t, y])
            dist.broadcast(ty, src=leader, group=sp_group)
            t, y = ty[0], ty[1]
            noise = torch.randn_like(x0)
            ab = alphas_bar[t][:, None, None]
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, tok_slice, t, y)
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            update_ema(ema, model.module)

            running += loss.item()
            log_steps += 1
            train_steps += 1
            if train_steps % args.log_every == 0:
                torch.cuda.synchronize()
                avg = torch.tensor(running / log_steps, device=device)
                dist.all_reduce(avg, op=dist.ReduceOp.SUM)
                if rank == 0:
                    logger.info(f"(step={train_steps:07d}) loss {avg.item() / world:.4f} "
                                f"steps/s {log_steps / (time() - start):.2f}")
                running, log_steps, start = 0.0, 0, time()

            if train_steps % args.ckpt_every == 0:
                if rank == 0:
                    ckpt = {"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                            "args": vars(args)}
                    torch.save(ckpt, f"{args.results}/{train_steps:07d}.pt")
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--results", default="results")
    parser.add_argument("--latent-size", type=int, default=256)
    parser.add_argument("--sp", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--ckpt-every", type=int, default=10000)
    main(parser.parse_args())
