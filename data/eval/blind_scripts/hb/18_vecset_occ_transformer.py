"""Latent-set occupancy autoencoder (3DShape2VecSet-style) on Objaverse/ShapeNet surface samples.

Cross-attention from a point cloud onto M learned latents, a stack of self-attention blocks,
and cross-attention from query points to predict occupancy. Activation checkpointing for the
self-attention stack, bf16 autocast, gradient accumulation.

    torchrun --nnodes=1 --nproc_per_node=8 18_vecset_occ_transformer.py --data_list data/objects_train.txt \
        --val_list data/objects_val.txt --out /shared/ckpt/vecset_ae
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SurfaceOccupancy(Dataset):
    def __init__(self, list_file, n_surface=2048, n_vol=1024, n_near=1024):
        with open(list_file) as f:
            self.files = [l.strip() for l in f if l.strip()]
        self.n_surface, self.n_vol, self.n_near = n_surface, n_vol, n_near

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        surf = d["surface"]
        vol_p, vol_o = d["vol_points"], d["vol_label"]
        near_p, near_o = d["near_points"], d["near_label"]
        s = np.random.choice(len(surf), self.n_surface, replace=False)
        a = np.random.randint(len(vol_p), size=self.n_vol)
        b = np.random.randint(len(near_p), size=self.n_near)
        pts = np.concatenate([vol_p[a], near_p[b]]).astype(np.float32)
        occ = np.concatenate([vol_o[a], near_o[b]]).astype(np.float32)
        return torch.from_numpy(surf[s].astype(np.float32)), torch.from_numpy(pts), torch.from_numpy(occ)


class FourierEmbed(nn.Module):
    def __init__(self, dim, n_freq=8):
        super().__init__()
        self.register_buffer("freqs", (2.0 ** torch.arange(n_freq)) * math.pi, persistent=False)
        self.proj = nn.Linear(3 + 6 * n_freq, dim)

    def forward(self, p):
        x = (p.unsqueeze(-1) * self.freqs).flatten(-2)
        return self.proj(torch.cat([p, x.sin(), x.cos()], -1))


class Attention(nn.Module):
    def __init__(self, dim, heads=8, ctx_dim=None):
        super().__init__()
        ctx_dim = ctx_dim or dim
        self.heads = heads
        self.norm_q = nn.LayerNorm(dim)
        self.norm_kv = nn.LayerNorm(ctx_dim)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(ctx_dim, 2 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, ctx=None):
        q_in = self.norm_q(x)
        kv_in = q_in if ctx is None else self.norm_kv(ctx)
        B, N, D = x.shape
        q = self.to_q(q_in).view(B, N, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(kv_in).view(B, kv_in.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        x = x + self.out(h)
        return x + self.ff(x)


class VecSetAE(nn.Module):
    def __init__(self, dim=512, n_latents=512, depth=12, grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.latents = nn.Parameter(torch.randn(n_latents, dim) * 0.02)
        self.embed = FourierEmbed(dim)
        self.encode_attn = Attention(dim, heads=1)
        self.blocks = nn.ModuleList([Attention(dim) for _ in range(depth)])
        self.decode_attn = Attention(dim, heads=1)
        self.head = nn.Linear(dim, 1)

    def forward(self, surface, queries):
        x = self.encode_attn(self.latents.expand(surface.shape[0], -1, -1), self.embed(surface))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.head(self.decode_attn(self.embed(queries), x)).squeeze(-1)


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_list", required=True)
    ap.add_argument("--val_list", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--global_batch", type=int, default=512)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--total_steps", type=int, default=200000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--val_every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    accum = args.global_batch // (args.micro_batch * world)
    assert accum * args.micro_batch * world == args.global_batch, "global batch must divide evenly"

    # one shared base seed for the run, picked on rank 0
    seed = torch.randint(0, 2 ** 31 - 1, (1,), device=device) if rank == 0 else torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(seed, src=0)
    base_seed = int(seed.item())
    torch.manual_seed(base_seed + rank)
    np.random.seed((base_seed + rank) % 2 ** 32)

    train_ds = SurfaceOccupancy(args.data_list)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=base_seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_ds = SurfaceOccupancy(args.val_list, n_vol=4096, n_near=4096)
    val_idx = list(range(rank, len(val_ds), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=8, num_workers=4)

    model = DDP(VecSetAE().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)

    step, epoch = 0, 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="vecset-ae", config={**vars(args), "world": world, "accum": accum},
                   dir=args.out, resume="allow")

    model.train()
    while step < args.total_steps:
        sampler.set_epoch(epoch)
        data_iter = iter(loader)
        for _ in range(len(loader) // accum):
            t0 = time.time()
            for g in opt.param_groups:
                g["lr"] = cosine_lr(step, args.total_steps, args.warmup, args.lr)
            loss_acc = torch.zeros((), device=device)
            for micro in range(accum):
                surf, pts, occ = (t.to(device, non_blocking=True) for t in next(data_iter))
                # grads are all-reduced only on the last micro-batch
                ctx = model.no_sync() if micro < accum - 1 else contextlib.nullcontext()
                with ctx:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        logits = model(surf, pts)
                        loss = F.binary_cross_entropy_with_logits(logits.float(), occ) / accum
                    loss.backward()
                loss_acc += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/bce": loss_acc.item(), "lr": opt.param_groups[0]["lr"],
                               "sec_per_step": time.time() - t0}, step=step)

            if step % args.val_every == 0:
                model.eval()
                stats = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for surf, pts, occ in val_loader:
                        surf, pts, occ = surf.to(device), pts.to(device), occ.to(device)
                        pred = model.module(surf, pts) > 0
                        gt = occ > 0.5
                        iou = (pred & gt).sum(1).float() / (pred | gt).sum(1).float().clamp(min=1)
                        stats += torch.stack([iou.sum(), torch.tensor(float(len(iou)), device=device)])
                dist.all_reduce(stats)
                model.train()
                if rank == 0:
                    wandb.log({"val/iou": (stats[0] / stats[1]).item()}, step=step)
                    tmp = ckpt_path + ".tmp"
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "step": step, "epoch": epoch}, tmp)
                    os.replace(tmp, ckpt_path)
                dist.barrier()
            if step >= args.total_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
