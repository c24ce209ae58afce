"""Conditional diffusion for frame interpolation (LDMVFI-like, but in pixel space on 128x128 crops).

The denoiser sees [x_t, frame0, frame1] and predicts the noise; sampling uses DDIM.

    torchrun --nproc_per_node=8 14_diffusion_vfi_vimeo.py --data /data/vimeo_triplet --work_dir work/diffvfi
"""
import argparse
import copy
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


@dataclass
class Config:
    data: str
    work_dir: str = "work/diffvfi"
    crop: int = 128
    batch_size: int = 32  # per GPU
    lr: float = 1e-4
    epochs: int = 60
    timesteps: int = 1000
    ddim_steps: int = 25
    ema_decay: float = 0.9995
    eval_samples: int = 512
    num_workers: int = 8


class Triplets(Dataset):
    def __init__(self, root, split, crop):
        lst = "tri_trainlist.txt" if split == "train" else "tri_testlist.txt"
        with open(os.path.join(root, lst)) as f:
            self.seqs = [s.strip() for s in f if s.strip()]
        self.root, self.split, self.crop = os.path.join(root, "sequences"), split, crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        d = os.path.join(self.root, self.seqs[i])
        ims = np.stack([np.asarray(Image.open(os.path.join(d, f"im{k}.png")).convert("RGB")) for k in (1, 2, 3)])
        h, w = ims.shape[1:3]
        if self.split == "train":
            y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        else:
            y, x = (h - self.crop) // 2, (w - self.crop) // 2
        ims = ims[:, y:y + self.crop, x:x + self.crop]
        if self.split == "train":
            if random.random() < 0.5:
                ims = ims[:, :, ::-1]
            if random.random() < 0.5:
                ims = ims[::-1]
        t = torch.from_numpy(np.ascontiguousarray(ims)).permute(0, 3, 1, 2).float() / 127.5 - 1
        return t[0], t[1], t[2]


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device).float() / half)
    a = t.float()[:, None] * freqs[None]
    return torch.cat([a.cos(), a.sin()], 1)


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, 1, 1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x))) + self.t(temb)[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class CondUNet(nn.Module):
    def __init__(self, ch=128, mults=(1, 2, 2, 4)):
        super().__init__()
        tdim = ch * 4
        self.ch = ch
        self.temb = nn.Sequential(nn.Linear(ch, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(9, ch, 3, 1, 1)
        self.downs, self.ups = nn.ModuleList(), nn.ModuleList()
        c, skips = ch, [ch]
        for i, m in enumerate(mults):
            self.downs.append(ResBlock(c, ch * m, tdim))
            c = ch * m
            skips.append(c)
        self.mid = ResBlock(c, c, tdim)
        for m in reversed(mults):
            self.ups.append(ResBlock(c + skips.pop(), ch * m, tdim))
            c = ch * m
        self.out = nn.Sequential(nn.GroupNorm(32, c + skips.pop()), nn.SiLU(), nn.Conv2d(c + ch, 3, 3, 1, 1))

    def forward(self, xt, f0, f1, t):
        temb = self.temb(timestep_embedding(t, self.ch))
        h = self.inp(torch.cat([xt, f0, f1], 1))
        hs = [h]
        for i, blk in enumerate(self.downs):
            h = blk(h, temb)
            hs.append(h)
            if i < len(self.downs) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h, temb)
        for i, blk in enumerate(self.ups):
            skip = hs.pop()
            if h.shape[-1] != skip.shape[-1]:
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = blk(torch.cat([h, skip], 1), temb)
        skip = hs.pop()
        h = F.interpolate(h, size=skip.shape[-2:], mode="nearest") if h.shape[-1] != skip.shape[-1] else h
        return self.out(torch.cat([h, skip], 1))


class Diffusion:
    def __init__(self, T, device):
        betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
        self.ac = torch.cumprod(1 - betas, 0).float().to(device)
        self.T = T

    def q_sample(self, x0, t, noise):
        a = self.ac[t].view(-1, 1, 1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    @torch.no_grad()
    def ddim(self, net, f0, f1, steps):
        x = torch.randn_like(f0)
        ts = torch.linspace(self.T - 1, 0, steps, device=f0.device).long()
        for i, t in enumerate(ts):
            a = self.ac[t]
            a_prev = self.ac[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, device=f0.device)
            eps = net(x, f0, f1, t.repeat(x.shape[0]))
            x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work_dir", default="work/diffvfi")
    ap.add_argument("--epochs", type=int, default=60)
    cfg = Config(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    net = CondUNet().to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    diff = Diffusion(cfg.timesteps, device)
    torch.manual_seed(100 + rank)

    train_set = Triplets(cfg.data, "train", cfg.crop)
    test_set = Triplets(cfg.data, "test", cfg.crop)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.num_workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    eval_idx = list(range(0, len(test_set), max(1, len(test_set) // cfg.eval_samples)))[:cfg.eval_samples]
    my_eval = eval_idx[rank::world]

    if rank == 0:
        os.makedirs(cfg.work_dir, exist_ok=True)
        print(f"{len(train_set)} training triplets, {len(train_loader)} iters/epoch/GPU, world {world}")

    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        for f0, gt, f1 in train_loader:
            f0, gt, f1 = (v.to(device, non_blocking=True) for v in (f0, gt, f1))
            t = torch.randint(0, cfg.timesteps, (gt.shape[0],), device=device)
            noise = torch.randn_like(gt)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(diff.q_sample(gt, t, noise), f0, f1, t)
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.mul_(cfg.ema_decay).add_(p.detach(), alpha=1 - cfg.ema_decay)
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        # DDIM reconstruction PSNR on a fixed subset of the test list
        acc = torch.zeros(2, device=device)
        gen = torch.Generator().manual_seed(0)
        for i in my_eval:
            f0, gt, f1 = (v.unsqueeze(0).to(device) for v in test_set[i])
            torch.manual_seed(int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen)) + i)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = diff.ddim(ema, f0, f1, cfg.ddim_steps).float()
            mse = (((pred + 1) / 2 - (gt + 1) / 2) ** 2).mean()
            acc[0] += -10 * torch.log10(mse)
            acc[1] += 1
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch}: DDIM-{cfg.ddim_steps} PSNR {(acc[0] / acc[1]).item():.3f} on {int(acc[1])} triplets")
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg.work_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()
        torch.manual_seed(100 + rank + 1000 * (epoch + 1))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
