"""
Rectified-flow text-to-video DiT on precomputed video latents + T5 embeddings.

    accelerate launch --config_file configs/accelerate_8gpu_bf16.yaml train_t2v_dit.py \
        --train_dir /mnt/latents/openvid_256 --output_dir exps/t2v_dit_L
"""
import argparse
import copy
import glob
import math
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from einops import rearrange
from timm.models.vision_transformer import Mlp
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm


class LatentClipDataset(Dataset):
    """Each sample: {'latent': [C, T, H, W] fp16, 'text': [L, 4096] fp16, 'mask': [L] bool}."""

    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "*.pt")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = torch.load(self.files[i], map_location="cpu", weights_only=True)
        return d["latent"].float(), d["text"].float(), d["mask"]


class CrossDiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.xattn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = Mlp(dim, 4 * dim, act_layer=lambda: nn.GELU(approximate="tanh"))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, ctx, ctx_mask, t):
        s1, g1, b1, s2, g2, b2 = self.ada(t)[:, None].chunk(6, -1)
        h = self.n1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        x = x + self.xattn(self.n2(x), ctx, ctx, key_padding_mask=~ctx_mask, need_weights=False)[0]
        x = x + g2 * self.mlp(self.n3(x) * (1 + s2) + b2)
        return x


class T2VDiT(nn.Module):
    def __init__(self, in_ch=16, patch=(1, 2, 2), dim=1024, depth=24, heads=16, text_dim=4096, max_tokens=8192,
                 cfg_drop=0.1):
        super().__init__()
        self.patch, self.in_ch, self.cfg_drop = patch, in_ch, cfg_drop
        self.embed = nn.Conv3d(in_ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, max_tokens, dim))
        self.text_proj = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.null_text = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.t_mlp = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([CrossDiTBlock(dim, heads) for _ in range(depth)])
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada_out = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.out = nn.Linear(dim, math.prod(patch) * in_ch)
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @staticmethod
    def t_freq(t, dim=256):
        f = torch.exp(-math.log(10000) * torch.arange(dim // 2, device=t.device) / (dim // 2))
        a = t[:, None] * 1000 * f[None]
        return torch.cat([a.cos(), a.sin()], -1)

    def forward(self, x, t, text, text_mask, force_uncond=False):
        B, C, T, H, W = x.shape
        pt, ph, pw = self.patch
        h = rearrange(self.embed(x), "b d t h w -> b (t h w) d")
        h = h + self.pos[:, : h.shape[1]]
        if force_uncond or (self.training and random.random() < self.cfg_drop):
            ctx = self.null_text.expand(B, 1, -1)
            ctx_mask = torch.ones(B, 1, dtype=torch.bool, device=x.device)
        else:
            ctx = self.text_proj(text)
            ctx_mask = text_mask
        temb = self.t_mlp(self.t_freq(t))
        for blk in self.blocks:
            h = blk(h, ctx, ctx_mask, temb)
        shift, scale = self.ada_out(temb)[:, None].chunk(2, -1)
        h = self.out(self.norm_out(h) * (1 + scale) + shift)
        return rearrange(h, "b (t h w) (pt ph pw c) -> b c (t pt) (h ph) (w pw)", t=T // pt, h=H // ph, w=W // pw,
                         pt=pt, ph=ph, pw=pw, c=C)


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, p in zip(ema.parameters(), model.parameters()):
        pe.lerp_(p.detach(), 1 - decay)


@torch.no_grad()
def sample(model, text, mask, shape, steps=30, cfg=6.0, device="cuda"):
    x = torch.randn(shape, device=device)
    ts = torch.linspace(1.0, 0.0, steps + 1, device=device)
    for i in range(steps):
        t = ts[i].expand(shape[0])
        v_c = model(x, t, text, mask)
        v_u = model(x, t, text, mask, force_uncond=True)
        v = v_u + cfg * (v_c - v_u)
        x = x + (ts[i + 1] - ts[i]) * v
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--ema_decay", type=float, default=0.9995)
    ap.add_argument("--cfg_drop", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--sample_every", type=int, default=2500)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="wandb")
    set_seed(args.seed, device_specific=True)
    accelerator.init_trackers("t2v-dit", config=vars(args))

    model = T2VDiT(cfg_drop=args.cfg_drop)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    ds = LatentClipDataset(args.train_dir)
    dl = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=8, pin_memory=True, drop_last=True)
    # the scheduler is stepped by hand once per optimizer update, so it is not passed to prepare()
    model, opt, dl = accelerator.prepare(model, opt, dl)
    ema.to(accelerator.device)
    accelerator.register_for_checkpointing(ema, sched)

    global_step = 0
    if args.resume:
        ckpts = sorted(glob.glob(os.path.join(args.output_dir, "step_*")), key=lambda p: int(p.split("_")[-1]))
        if ckpts:
            accelerator.load_state(ckpts[-1])
            global_step = int(ckpts[-1].split("_")[-1])
            accelerator.print(f"resumed from {ckpts[-1]}")

    # fixed prompts for periodic sampling, taken from the first few training files
    vis = [ds[i] for i in range(4)]
    vis_text = torch.stack([v[1] for v in vis]).to(accelerator.device)
    vis_mask = torch.stack([v[2] for v in vis]).to(accelerator.device)
    lat_shape = (4,) + tuple(vis[0][0].shape)

    pbar = tqdm(total=args.max_steps, initial=global_step, disable=not accelerator.is_main_process)
    model.train()
    while global_step < args.max_steps:
        for x0, text, mask in dl:
            with accelerator.accumulate(model):
                b = x0.shape[0]
                # logit-normal timestep sampling (SD3)
                t = torch.sigmoid(torch.randn(b, device=x0.device))
                noise = torch.randn_like(x0)
                xt = (1 - t.view(b, 1, 1, 1, 1)) * x0 + t.view(b, 1, 1, 1, 1) * noise
                with accelerator.autocast():
                    v = model(xt, t, text, mask)
                loss = F.mse_loss(v.float(), (noise - x0).float())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    gnorm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            if not accelerator.sync_gradients:
                continue
            global_step += 1
            sched.step()
            pbar.update(1)
            ema_update(ema, accelerator.unwrap_model(model), args.ema_decay)

            if global_step % 20 == 0:
                loss_avg = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.log({"loss": loss_avg.item(), "grad_norm": gnorm.item(),
                                 "lr": sched.get_last_lr()[0]}, step=global_step)

            if global_step % args.save_every == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{global_step}"))

            if global_step % args.sample_every == 0 and accelerator.is_main_process:
                ema.eval()
                with accelerator.autocast():
                    lat = sample(ema, vis_text, vis_mask, lat_shape, device=accelerator.device)
                torch.save(lat.cpu(), os.path.join(args.output_dir, f"samples_{global_step}.pt"))
            if global_step >= args.max_steps:
                break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(ema.state_dict(), os.path.join(args.output_dir, "ema_final.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
