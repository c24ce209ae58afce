"""
Text-to-video DiT on pre-encoded VAE latents (rectified flow), resumable.

torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
    17_video_dit_flow.py --config configs/vdit_b.yaml [--resume auto]
"""
import argparse
import copy
import glob
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class LatentClips(Dataset):
    """Each .pt holds {'latent': (C, T, H, W) bf16, 'text': (L, 4096) T5 states, 'text_mask': (L,)}."""

    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.pt")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu")
        return d["latent"].float(), d["text"].float(), d["text_mask"]


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(d, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.n2 = nn.LayerNorm(d, elementwise_affine=False)
        self.cross = nn.MultiheadAttention(d, heads, batch_first=True)
        self.n3 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, x, c, txt, txt_pad):
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, -1)
        h = modulate(self.n1(x), s1, sc1)
        x = x + g1.unsqueeze(1) * self.attn(h, h, h, need_weights=False)[0]
        x = x + self.cross(self.n2(x), txt, txt, key_padding_mask=txt_pad, need_weights=False)[0]
        h = modulate(self.n3(x), s2, sc2)
        return x + g2.unsqueeze(1) * self.mlp(h)


class VideoDiT(nn.Module):
    def __init__(self, in_ch=16, patch=(1, 2, 2), d=1024, depth=24, heads=16, txt_dim=4096, max_tokens=8192):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv3d(in_ch, d, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, max_tokens, d) * 0.02)
        self.txt_proj = nn.Linear(txt_dim, d)
        self.t_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([DiTBlock(d, heads) for _ in range(depth)])
        self.out_norm = nn.LayerNorm(d, elementwise_affine=False)
        self.out = nn.Linear(d, in_ch * math.prod(patch))
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def t_embed(self, t):
        half = 128
        f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
        a = t[:, None] * 1000 * f[None]
        return self.t_mlp(torch.cat([a.sin(), a.cos()], -1))

    def forward(self, x, t, txt, txt_mask):
        B, C, T, H, W = x.shape
        pt, ph, pw = self.patch
        h = self.embed(x).flatten(2).transpose(1, 2)
        h = h + self.pos[:, : h.size(1)]
        c = self.t_embed(t)
        txt = self.txt_proj(txt)
        for blk in self.blocks:
            h = blk(h, c, txt, ~txt_mask.bool())
        h = self.out(self.out_norm(h))
        h = h.view(B, T // pt, H // ph, W // pw, C, pt, ph, pw)
        return h.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, C, T, H, W)


@torch.no_grad()
def update_ema(ema, model, decay=0.9999):
    for (_, pe), (_, pm) in zip(ema.named_parameters(), model.named_parameters()):
        pe.lerp_(pm.detach(), 1 - decay)


def save_checkpoint(path, model, ema, opt, step):
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step}, path)


def latest_checkpoint(d):
    ck = sorted(glob.glob(os.path.join(d, "step_*.pt")))
    return ck[-1] if ck else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    cfg = OmegaConf.load(args.config)
    resume = args.resume

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    model = VideoDiT(**cfg.model).to(dev)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    step = 0
    if resume == "auto":
        resume = latest_checkpoint(cfg.ckpt_dir)
    if resume:
        ck = torch.load(resume, map_location=dev)
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        if rank == 0:
            print(f"resumed from {resume} @ step {step}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    ds = LatentClips(cfg.data_root)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed)
    dl = DataLoader(ds, batch_size=cfg.bsz, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    epoch = step // len(dl)

    if rank == 0:
        import wandb
        wandb.init(project="video-dit", config=OmegaConf.to_container(cfg), resume="allow")
        os.makedirs(cfg.ckpt_dir, exist_ok=True)

    t0 = time.time()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for lat, txt, txt_mask in dl:
            lat, txt, txt_mask = lat.to(dev), txt.to(dev), txt_mask.to(dev)
            # rectified flow: x_t = (1 - t) x0 + t * eps, target v = eps - x0 ; logit-normal t
            t = torch.sigmoid(torch.randn(lat.size(0), device=dev))
            eps = torch.randn_like(lat)
            tt = t.view(-1, 1, 1, 1, 1)
            x_t = (1 - tt) * lat + tt * eps
            drop = torch.rand(lat.size(0), device=dev) < cfg.cfg_drop
            txt_mask = txt_mask.masked_fill(drop[:, None], 0)
            txt_mask[:, 0] = 1  # keep at least one key so attention is defined
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v = model(x_t, t, txt, txt_mask)
            loss = F.mse_loss(v.float(), eps - lat)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            update_ema(ema, model.module)
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "grad_norm": gn.item(),
                               "it_s": 50 / (time.time() - t0)}, step=step)
                t0 = time.time()
            if step % cfg.save_every == 0:
                if rank == 0:
                    save_checkpoint(os.path.join(cfg.ckpt_dir, f"step_{step:08d}.pt"), model, ema, opt, step)
                dist.barrier()
            if step >= cfg.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
