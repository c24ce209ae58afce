# Small factorised space-time video diffusion model (2D conv + temporal attention),
# 16 frames at 64x64 on UCF-101, class conditional.
#
#   torchrun --nproc_per_node=8 train_vdm.py --root /data/UCF-101 --split /data/ucfTrainTestlist --out runs/vdm_ucf
import argparse
import copy
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import UCF101
from torchvision.io import write_video


def sinusoidal(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    a = t.float()[:, None] * f[None]
    return torch.cat([a.sin(), a.cos()], 1)


class SpaceTimeBlock(nn.Module):
    def __init__(self, ci, co, edim, frames, t_attn=True):
        super().__init__()
        self.frames = frames
        self.n1, self.c1 = nn.GroupNorm(32, ci), nn.Conv2d(ci, co, 3, padding=1)
        self.emb = nn.Linear(edim, co)
        self.n2, self.c2 = nn.GroupNorm(32, co), nn.Conv2d(co, co, 3, padding=1)
        self.skip = nn.Conv2d(ci, co, 1) if ci != co else nn.Identity()
        self.t_attn = nn.MultiheadAttention(co, 8, batch_first=True) if t_attn else None
        self.t_norm = nn.LayerNorm(co) if t_attn else None
        self.t_pos = nn.Parameter(torch.zeros(1, frames, co)) if t_attn else None

    def forward(self, x, e):
        # x: (b*f, c, h, w), e: (b*f, edim)
        h = self.c1(F.silu(self.n1(x))) + self.emb(e)[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        x = self.skip(x) + h
        if self.t_attn is not None:
            bf, c, hh, ww = x.shape
            s = rearrange(x, "(b f) c h w -> (b h w) f c", f=self.frames)
            q = self.t_norm(s + self.t_pos)
            s = s + self.t_attn(q, q, q, need_weights=False)[0]
            x = rearrange(s, "(b h w) f c -> (b f) c h w", h=hh, w=ww)
        return x


class VideoUNet(nn.Module):
    def __init__(self, frames=16, ch=128, mult=(1, 2, 3, 4), num_classes=101):
        super().__init__()
        self.frames, self.ch = frames, ch
        edim = ch * 4
        self.t_mlp = nn.Sequential(nn.Linear(ch, edim), nn.SiLU(), nn.Linear(edim, edim))
        self.cls = nn.Embedding(num_classes + 1, edim)
        self.null_class = num_classes
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.downs, self.ups = nn.ModuleList(), nn.ModuleList()
        c, cs = ch, [ch]
        for i, m in enumerate(mult):
            self.downs.append(SpaceTimeBlock(c, ch * m, edim, frames))
            c = ch * m
            cs.append(c)
            if i < len(mult) - 1:
                self.downs.append(nn.Conv2d(c, c, 3, 2, 1))
                cs.append(c)
        self.mid = SpaceTimeBlock(c, c, edim, frames)
        for i, m in reversed(list(enumerate(mult))):
            self.ups.append(SpaceTimeBlock(c + cs.pop(), ch * m, edim, frames))
            c = ch * m
            if i > 0:
                self.ups.append(SpaceTimeBlock(c + cs.pop(), c, edim, frames, t_attn=False))
                self.ups.append(nn.Upsample(scale_factor=2))
        self.ups.append(SpaceTimeBlock(c + cs.pop(), ch, edim, frames, t_attn=False))
        self.out = nn.Sequential(nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x, t, y):
        b = x.shape[0]
        x = rearrange(x, "b c f h w -> (b f) c h w")
        e = self.t_mlp(sinusoidal(t, self.ch)) + self.cls(y)
        e = e.repeat_interleave(self.frames, 0)
        h = self.inp(x)
        hs = [h]
        for m in self.downs:
            h = m(h, e) if isinstance(m, SpaceTimeBlock) else m(h)
            hs.append(h)
        h = self.mid(h, e)
        for m in self.ups:
            h = m(torch.cat([h, hs.pop()], 1), e) if isinstance(m, SpaceTimeBlock) else m(h)
        return rearrange(self.out(h), "(b f) c h w -> b c f h w", b=b)


def cosine_schedule(T=1000):
    s = torch.linspace(0, T, T + 1) / T
    ab = torch.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = (1 - ab[1:] / ab[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0)


def video_transform(v):
    # v: (T, H, W, C) uint8 -> (C, T, 64, 64) in [-1, 1]
    v = v.permute(3, 0, 1, 2).float() / 127.5 - 1
    v = F.interpolate(v, size=(64, 64), mode="bilinear", align_corners=False, antialias=True)
    return v


def collate(batch):
    vids = torch.stack([b[0] for b in batch])
    labels = torch.tensor([b[2] for b in batch])
    return vids, labels


@torch.no_grad()
def sample(net, y, abar, frames, steps=100):
    dev = y.device
    x = torch.randn(len(y), 3, frames, 64, 64, device=dev)
    ts = torch.linspace(len(abar) - 1, 0, steps, device=dev).long()
    for i, t in enumerate(ts):
        eps = net(x, t.repeat(len(y)), y)
        a = abar[t]
        an = abar[ts[i + 1]] if i + 1 < steps else torch.ones((), device=dev)
        x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
        x = an.sqrt() * x0 + (1 - an).sqrt() * eps
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--split", required=True)
    ap.add_argument("--out", default="runs/vdm")
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--bs", type=int, default=4, help="clips per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    # building the clip index is slow; rank 0 does it first and the others reuse torchvision's metadata
    meta_path = os.path.join(args.out, f"ucf_meta_{args.frames}.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if not os.path.exists(meta_path):
            ds0 = UCF101(args.root, args.split, frames_per_clip=args.frames, step_between_clips=8, fold=1,
                         train=True, num_workers=16, output_format="THWC")
            torch.save(ds0.metadata, meta_path)
    dist.barrier()
    meta = torch.load(meta_path)
    ds = UCF101(args.root, args.split, frames_per_clip=args.frames, step_between_clips=8, fold=1, train=True,
                transform=video_transform, _precomputed_metadata=meta, output_format="THWC")
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    net = VideoUNet(frames=args.frames).to(dev)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = torch.cuda.amp.GradScaler()
    start_epoch = 0
    ck_file = os.path.join(args.out, "last.pt")
    if os.path.exists(ck_file):
        ck = torch.load(ck_file, map_location="cpu")
        net.load_state_dict(ck["net"]); ema.load_state_dict(ck["ema"]); opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"]); start_epoch = ck["epoch"] + 1
    net = DDP(net, device_ids=[local_rank])
    abar = cosine_schedule().to(dev)

    step = 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        for x, y in dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            y = torch.where(torch.rand(y.shape, device=dev) < args.p_uncond, torch.full_like(y, net.module.null_class), y)
            t = torch.randint(0, len(abar), (x.size(0),), device=dev)
            noise = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1, 1)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = net(a.sqrt() * x + (1 - a).sqrt() * noise, t, y)
            loss = F.mse_loss(pred.float(), noise)
            if not torch.isfinite(loss):
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch", flush=True)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.module.parameters()):
                    pe.lerp_(p, 1e-4)
            step += 1
            if step % 50 == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {lt.item() / world:.4f} scale {scaler.get_scale():.0f}",
                          flush=True)

        if rank == 0:
            print(f"epoch {epoch} took {(time.time() - t0) / 60:.1f} min", flush=True)
            y = torch.tensor([0, 10, 30, 50, 70, 90], device=dev)
            vids = sample(ema, y, abar, args.frames)
            vids = ((vids.clamp(-1, 1) + 1) * 127.5).byte().permute(0, 2, 3, 4, 1).cpu()
            for i, v in enumerate(vids):
                write_video(os.path.join(args.out, f"ep{epoch:03d}_{i}.mp4"), v, fps=8)
            torch.save({"net": net.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, ck_file)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
