"""
Joint text-to-video / image-to-video DiT training (first-frame conditioning on a fraction of batches).
Activation checkpointing on every transformer block so 33-frame 256px clips fit at batch 4 on 80GB.

    torchrun --nproc_per_node 8 train_ti2v.py --data_dir /data/latents_33x256 --exp_dir exps/ti2v_xl
"""
import argparse
import glob
import math
import os
import random
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_dim=None):
        super().__init__()
        self.h = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(kv_dim or dim, 2 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, ctx=None):
        ctx = x if ctx is None else ctx
        q = rearrange(self.q(x), "b n (h d) -> b h n d", h=self.h)
        k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.h) for t in self.kv(ctx).chunk(2, -1))
        return self.o(rearrange(F.scaled_dot_product_attention(q, k, v), "b h n d -> b n (h d)"))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        self.n2 = nn.LayerNorm(dim)
        self.cross = Attention(dim, heads)
        self.n3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c, ctx):
        s1, b1, g1, s2, b2, g2 = self.ada(c)[:, None].chunk(6, -1)
        x = x + g1 * self.attn(self.n1(x) * (1 + s1) + b1)
        x = x + self.cross(self.n2(x), ctx)
        return x + g2 * self.mlp(self.n3(x) * (1 + s2) + b2)


class TI2VDiT(nn.Module):
    def __init__(self, in_ch=16, dim=1152, depth=28, heads=16, text_dim=4096, patch=2, grad_ckpt=True):
        super().__init__()
        self.p, self.in_ch, self.grad_ckpt = patch, in_ch, grad_ckpt
        self.x_in = nn.Linear(in_ch * patch * patch, dim)
        # first-frame latent (clean) enters through its own projection, added to frame-0 tokens
        self.img_in = nn.Sequential(nn.Linear(in_ch * patch * patch, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.txt_in = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.t_in = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.pos = nn.Parameter(torch.randn(1, 9 * 256, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.out = nn.Linear(dim, in_ch * patch * patch)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, t, txt, first_frame=None):
        B, C, T, H, W = x.shape
        p = self.p
        tok = rearrange(x, "b c t (h p) (w q) -> b t (h w) (c p q)", p=p, q=p)
        h = self.x_in(tok)
        if first_frame is not None:
            ff = rearrange(first_frame, "b c (h p) (w q) -> b (h w) (c p q)", p=p, q=p)
            h = torch.cat([h[:, :1] + self.img_in(ff)[:, None], h[:, 1:]], dim=1)
        h = h.flatten(1, 2) + self.pos[:, : T * tok.shape[2]]
        f = torch.exp(-math.log(10000) * torch.arange(128, device=x.device) / 128)
        c = self.t_in(torch.cat([(t[:, None] * f).cos(), (t[:, None] * f).sin()], -1))
        ctx = self.txt_in(txt)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = torch.utils.checkpoint.checkpoint(blk, h, c, ctx)
            else:
                h = blk(h, c, ctx)
        h = self.out(self.norm(h))
        return rearrange(h, "b (t h w) (c p q) -> b c t (h p) (w q)", t=T, h=H // p, w=W // p, p=p, q=p)


class Latents(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.pt")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu", weights_only=True)
        return d["z"].float(), d["t5"].float()  # z: [16, 9, 32, 32] (33 frames, 4x causal VAE)


@torch.no_grad()
def update_ema(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--exp_dir", required=True)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--i2v_prob", type=float, default=0.3)
    ap.add_argument("--text_drop", type=float, default=0.1)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--ckpt_every", type=int, default=5000)
    ap.add_argument("--no_grad_ckpt", action="store_true")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    torch.manual_seed(0)
    model = TI2VDiT(grad_ckpt=not args.no_grad_ckpt).to(device)
    ema = deepcopy(model).eval().requires_grad_(False)
    torch.manual_seed(rank + 1)
    random.seed(rank + 1)
    # img_in only runs on i2v batches, so some steps leave it without gradients
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step, start_epoch = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        step, start_epoch = ck["step"], ck["epoch"] + 1

    ds = Latents(args.data_dir)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    null_txt = torch.zeros(1, 1, 4096, device=device)

    if rank == 0:
        os.makedirs(os.path.join(args.exp_dir, "ckpt"), exist_ok=True)
        wandb.init(project="ti2v-dit", dir=args.exp_dir, config=vars(args))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for z, txt in dl:
            z, txt = z.to(device, non_blocking=True), txt.to(device, non_blocking=True)
            B = z.shape[0]
            keep = (torch.rand(B, 1, 1, device=device) > args.text_drop)
            txt = torch.where(keep, txt, null_txt.expand(B, txt.shape[1], -1))
            first = z[:, :, 0] if random.random() < args.i2v_prob else None

            t = torch.sigmoid(torch.randn(B, device=device))  # logit-normal
            noise = torch.randn_like(z)
            zt = (1 - t.view(B, 1, 1, 1, 1)) * z + t.view(B, 1, 1, 1, 1) * noise
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v = model(zt, t, txt, first_frame=first)
            loss = F.mse_loss(v.float(), noise - z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            update_ema(ema, model.module, args.ema_decay)
            step += 1

            if step % 25 == 0:
                rep = torch.stack([loss.detach(), gn.detach()])
                dist.all_reduce(rep)
                rep /= world
                if rank == 0:
                    wandb.log({"loss": rep[0].item(), "grad_norm": rep[1].item(), "epoch": epoch}, step=step)

            if step % args.ckpt_every == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "step": step, "epoch": epoch},
                               os.path.join(args.exp_dir, "ckpt", f"{step:07d}.pt"))
                dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
