"""Image-to-video latent diffusion (first-frame conditioning by channel concat), DeepSpeed ZeRO-3, bf16, EMA.

    deepspeed --num_gpus=8 18_i2v_deepspeed_zero3.py --latents /data/i2v_latents --out runs/i2v_z3
"""
import argparse
import copy
import glob
import math
import os
import random

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 1000}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 1000,
    }


class LatentVideos(Dataset):
    def __init__(self, root, frames=14):
        self.files = sorted(glob.glob(os.path.join(root, "*.npy")))
        self.frames = frames

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        lat = np.load(self.files[i], mmap_mode="r")  # T, 4, 40, 64
        s = random.randint(0, max(0, lat.shape[0] - self.frames))
        x = torch.from_numpy(np.array(lat[s:s + self.frames], dtype=np.float32))
        if x.shape[0] < self.frames:
            x = torch.cat([x, x[-1:].repeat(self.frames - x.shape[0], 1, 1, 1)])
        return x.transpose(0, 1) * 0.18215  # C T H W


def t_embed(sigma, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half, device=sigma.device) / half)
    a = (0.25 * sigma.log()).float()[:, None] * f[None] * 1000
    return torch.cat([a.sin(), a.cos()], 1)


class STBlock(nn.Module):
    def __init__(self, cin, cout, emb, heads=8):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.e = nn.Linear(emb, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, 1, 1)
        self.sk = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        self.tn = nn.LayerNorm(cout)
        self.ta = nn.MultiheadAttention(cout, heads, batch_first=True)

    def forward(self, x, emb, frames):
        h = self.c1(F.silu(self.n1(x))) + self.e(emb).repeat_interleave(frames, 0)[:, :, None, None]
        x = self.sk(x) + self.c2(F.silu(self.n2(h)))
        bt, c, hh, ww = x.shape
        b = bt // frames
        seq = x.view(b, frames, c, hh * ww).permute(0, 3, 1, 2).reshape(b * hh * ww, frames, c)
        q = self.tn(seq)
        seq = seq + self.ta(q, q, q, need_weights=False)[0]
        return seq.view(b, hh * ww, frames, c).permute(0, 2, 3, 1).reshape(bt, c, hh, ww)


class I2VUNet(nn.Module):
    def __init__(self, ch=192, mults=(1, 2, 4)):
        super().__init__()
        emb = ch * 4
        self.ch = ch
        self.emb = nn.Sequential(nn.Linear(ch, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.inp = nn.Conv2d(8, ch, 3, 1, 1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        c, skips = ch, []
        for m in mults:
            self.down.append(STBlock(c, ch * m, emb))
            c = ch * m
            skips.append(c)
        self.mid = STBlock(c, c, emb)
        for m in reversed(mults):
            self.up.append(STBlock(c + skips.pop(), ch * m, emb))
            c = ch * m
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 4, 3, 1, 1))

    def forward(self, x, cond, sigma):
        b, c, t, h, w = x.shape
        z = torch.cat([x, cond[:, :, None].expand(-1, -1, t, -1, -1)], 1)
        z = z.transpose(1, 2).reshape(b * t, 2 * c, h, w)
        emb = self.emb(t_embed(sigma, self.ch).to(z.dtype))
        z = self.inp(z)
        hs = []
        for i, blk in enumerate(self.down):
            z = blk(z, emb, t)
            hs.append(z)
            if i < len(self.down) - 1:
                z = F.avg_pool2d(z, 2)
        z = self.mid(z, emb, t)
        for i, blk in enumerate(self.up):
            s = hs.pop()
            if z.shape[-2:] != s.shape[-2:]:
                z = F.interpolate(z, size=s.shape[-2:], mode="nearest")
            z = blk(torch.cat([z, s], 1), emb, t)
        return self.out(z).view(b, t, c, h, w).transpose(1, 2)


def edm_loss(model, x0, p_mean=-1.2, p_std=1.2, sigma_data=0.5):
    b = x0.shape[0]
    sigma = (torch.randn(b, device=x0.device) * p_std + p_mean).exp()
    s = sigma.view(b, 1, 1, 1, 1)
    noisy = x0 + torch.randn_like(x0) * s
    c_skip = sigma_data ** 2 / (s ** 2 + sigma_data ** 2)
    c_out = s * sigma_data / (s ** 2 + sigma_data ** 2).sqrt()
    c_in = 1 / (s ** 2 + sigma_data ** 2).sqrt()
    cond = x0[:, :, 0]
    cond = cond + 0.02 * torch.randn_like(cond)  # noise augmentation on the conditioning frame
    f = model((c_in * noisy).to(torch.bfloat16), cond.to(torch.bfloat16), sigma)
    denoised = c_skip * noisy + c_out * f.float()
    weight = (s ** 2 + sigma_data ** 2) / (s * sigma_data) ** 2
    return (weight * (denoised - x0) ** 2).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--latents", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    model = I2VUNet()
    ema = copy.deepcopy(model).to(device).eval().requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    torch.manual_seed(rank + 1)

    ds = LatentVideos(args.latents)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    step, epoch = 0, 0
    if os.path.isdir(args.out) and os.path.exists(os.path.join(args.out, "latest")):
        _, client = engine.load_checkpoint(args.out)
        step = client["step"]
        ema.load_state_dict(torch.load(os.path.join(args.out, f"ema_{client['step']:07d}.pt"), map_location=device))
        epoch = client["epoch"]

    while step < args.steps:
        sampler.set_epoch(epoch)
        for x0 in loader:
            x0 = x0.to(device, non_blocking=True)
            loss = edm_loss(engine, x0)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if not boundary:
                continue
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), engine.module.parameters()):
                    pe.mul_(args.ema).add_(p.detach().float(), alpha=1 - args.ema)
            step += 1
            if step % 100 == 0:
                l = loss.detach().float().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {engine.get_lr()[0]:.2e}", flush=True)
            if step % args.save_every == 0:
                engine.save_checkpoint(args.out, tag=f"step{step:07d}", client_state={"step": step, "epoch": epoch})
                if rank == 0:
                    torch.save(ema.state_dict(), os.path.join(args.out, f"ema_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    engine.save_16bit_model(args.out, "unet_final_bf16.bin")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
