"""Pixel-space video diffusion (64x64, 16 frames) with joint image-video training.

Every --image_every-th step uses a batch of still images (T = 1) so that the spatial layers keep seeing a large
image corpus; the temporal layers are only run on real clips.

    torchrun --nproc_per_node=8 08_joint_image_video_diffusion.py --videos /data/webvid_64 --images /data/laion_64
"""
import argparse
import copy
import glob
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FrameFolderClips(Dataset):
    """Each video is a folder of 64x64 jpg frames."""

    def __init__(self, root, num_frames=16, max_stride=4):
        self.videos = sorted(d for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d))
        self.num_frames, self.max_stride = num_frames, max_stride

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        frames = sorted(os.listdir(self.videos[i]))
        stride = random.randint(1, self.max_stride)
        while stride > 1 and (self.num_frames - 1) * stride >= len(frames):
            stride -= 1
        start = random.randint(0, max(0, len(frames) - (self.num_frames - 1) * stride - 1))
        idx = [min(start + k * stride, len(frames) - 1) for k in range(self.num_frames)]
        x = np.stack([np.asarray(Image.open(os.path.join(self.videos[i], frames[j])).convert("RGB")) for j in idx])
        x = torch.from_numpy(x).permute(3, 0, 1, 2).float() / 127.5 - 1  # C T H W
        if random.random() < 0.5:
            x = x.flip(-1)
        return x


class ImageFolderFlat(Dataset):
    def __init__(self, root):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = torch.from_numpy(np.asarray(Image.open(self.files[i]).convert("RGB")).copy())
        x = x.permute(2, 0, 1).float() / 127.5 - 1
        if random.random() < 0.5:
            x = x.flip(-1)
        return x.unsqueeze(1)  # C 1 H W


def sinusoidal(t, dim):
    half = dim // 2
    f = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    a = t.float()[:, None] * f[None]
    return torch.cat([a.sin(), a.cos()], 1)


class SpatioTemporalBlock(nn.Module):
    def __init__(self, cin, cout, temb_dim, heads=4):
        super().__init__()
        self.norm1 = nn.GroupNorm(32, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.temb = nn.Linear(temb_dim, cout)
        self.norm2 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        # temporal part
        self.tnorm = nn.GroupNorm(32, cout)
        self.tconv = nn.Conv1d(cout, cout, 3, 1, 1)
        self.tattn_norm = nn.LayerNorm(cout)
        self.tattn = nn.MultiheadAttention(cout, heads, batch_first=True)
        nn.init.zeros_(self.tconv.weight)
        nn.init.zeros_(self.tconv.bias)
        nn.init.zeros_(self.tattn.out_proj.weight)
        nn.init.zeros_(self.tattn.out_proj.bias)

    def forward(self, x, emb):
        b, c, t, h, w = x.shape
        x2 = x.transpose(1, 2).reshape(b * t, c, h, w)
        hdn = self.conv1(F.silu(self.norm1(x2)))
        hdn = hdn + self.temb(emb).repeat_interleave(t, 0)[:, :, None, None]
        hdn = self.conv2(F.silu(self.norm2(hdn)))
        x2 = self.skip(x2) + hdn
        c = x2.shape[1]
        x = x2.view(b, t, c, h, w).transpose(1, 2)
        if t > 1:
            xt = F.silu(self.tnorm(x)).permute(0, 3, 4, 1, 2).reshape(b * h * w, c, t)
            xt = self.tconv(xt).view(b, h, w, c, t).permute(0, 3, 4, 1, 2)
            x = x + xt
            seq = x.permute(0, 3, 4, 2, 1).reshape(b * h * w, t, c)
            q = self.tattn_norm(seq)
            seq = seq + self.tattn(q, q, q, need_weights=False)[0]
            x = seq.view(b, h, w, t, c).permute(0, 4, 3, 1, 2)
        return x.contiguous()


class VideoUNet(nn.Module):
    def __init__(self, ch=128, mults=(1, 2, 2, 4)):
        super().__init__()
        temb = ch * 4
        self.temb = nn.Sequential(nn.Linear(ch, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(3, ch, 3, 1, 1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        chans, cur = [], ch
        for m in mults:
            self.down.append(SpatioTemporalBlock(cur, ch * m, temb))
            cur = ch * m
            chans.append(cur)
        self.mid = SpatioTemporalBlock(cur, cur, temb)
        for m, skip in zip(reversed(mults), reversed(chans)):
            self.up.append(SpatioTemporalBlock(cur + skip, ch * m, temb))
            cur = ch * m
        self.out = nn.Sequential(nn.GroupNorm(32, cur), nn.SiLU(), nn.Conv2d(cur, 3, 3, 1, 1))
        self.ch = ch

    @staticmethod
    def _spatial(fn, x):
        b, c, t, h, w = x.shape
        y = fn(x.transpose(1, 2).reshape(b * t, c, h, w))
        return y.view(b, t, *y.shape[1:]).transpose(1, 2)

    def forward(self, x, timesteps):
        emb = self.temb(sinusoidal(timesteps, self.ch))
        hdn = self._spatial(self.inp, x)
        skips = []
        for i, blk in enumerate(self.down):
            hdn = blk(hdn, emb)
            skips.append(hdn)
            if i < len(self.down) - 1:
                hdn = self._spatial(lambda z: F.avg_pool2d(z, 2), hdn)
        hdn = self.mid(hdn, emb)
        for i, blk in enumerate(self.up):
            if i > 0:
                hdn = self._spatial(lambda z: F.interpolate(z, scale_factor=2.0, mode="nearest"), hdn)
            hdn = blk(torch.cat([hdn, skips.pop()], 1), emb)
        return self._spatial(self.out, hdn)


def alpha_sigma(t):
    # cosine schedule, t in [0, 1]
    return torch.cos(t * math.pi / 2), torch.sin(t * math.pi / 2)


def v_loss(model, x0):
    b = x0.shape[0]
    t = torch.rand(b, device=x0.device)
    a, s = (v.view(b, 1, 1, 1, 1) for v in alpha_sigma(t))
    noise = torch.randn_like(x0)
    xt = a * x0 + s * noise
    target = a * noise - s * x0
    return F.mse_loss(model(xt, t * 1000), target)


@torch.no_grad()
def ddim_sample(net, n, frames, device, steps=50):
    x = torch.randn(n, 3, frames, 64, 64, device=device)
    ts = torch.linspace(1.0, 0.0, steps + 1, device=device)
    for i in range(steps):
        a, s = alpha_sigma(ts[i])
        a2, s2 = alpha_sigma(ts[i + 1])
        v = net(x, torch.full((n,), ts[i].item() * 1000, device=device))
        x0 = a * x - s * v
        eps = s * x + a * v
        x = a2 * x0 + s2 * eps
    return x.clamp(-1, 1)


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for b in loader:
            yield b
        epoch += 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--videos", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--out", default="out/joint_vdm")
    p.add_argument("--video_bs", type=int, default=4, help="per GPU")
    p.add_argument("--image_bs", type=int, default=64, help="per GPU")
    p.add_argument("--image_every", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=500000)
    p.add_argument("--ema", type=float, default=0.9999)
    p.add_argument("--sample_every", type=int, default=20000)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    net = VideoUNet().to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    step = 0
    ck = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ck):
        sd = torch.load(ck, map_location="cpu")
        net.load_state_dict(sd["net"])
        ema.load_state_dict(sd["ema"])
        opt.load_state_dict(sd["opt"])
        step = sd["step"]
    model = DDP(net, device_ids=[local_rank])
    torch.manual_seed(step * world + rank)

    vset, iset = FrameFolderClips(args.videos), ImageFolderFlat(args.images)
    vsamp = DistributedSampler(vset, shuffle=True, drop_last=True)
    isamp = DistributedSampler(iset, shuffle=True, drop_last=True)
    vload = DataLoader(vset, batch_size=args.video_bs, sampler=vsamp, num_workers=8, pin_memory=True, drop_last=True)
    iload = DataLoader(iset, batch_size=args.image_bs, sampler=isamp, num_workers=4, pin_memory=True, drop_last=True)
    vit, iit = infinite(vload, vsamp), infinite(iload, isamp)

    while step < args.steps:
        use_images = step % args.image_every == args.image_every - 1
        x0 = next(iit) if use_images else next(vit)
        x0 = x0.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = v_loss(model, x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for pe, pn in zip(ema.parameters(), net.parameters()):
                pe.lerp_(pn, 1 - args.ema)
        step += 1

        if step % 200 == 0:
            l = loss.detach().float()
            dist.all_reduce(l)
            if rank == 0:
                print(f"step {step} ({'img' if use_images else 'vid'}) loss {l.item() / world:.4f}", flush=True)
        if step % args.sample_every == 0:
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    vids = ddim_sample(ema, 4, 16, device)
                grid = (vids.float().transpose(1, 2).flatten(0, 1) + 1) / 2  # (4*16) C H W
                torchvision.utils.save_image(grid, os.path.join(args.out, f"sample_{step:07d}.png"), nrow=16)
                torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step},
                           ck)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
