"""NeRF on Blender scenes with per-image ray batches (each sample = N random rays of one view).

Usage:
    torchrun --standalone --nproc_per_node=4 08_nerf_synthetic_torchrun.py --config configs/lego.yaml
"""
import argparse
import json
import os
import random

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DEFAULTS = dict(data_root="data/nerf_synthetic/lego", out="runs/lego", epochs=300, images_per_step=8,
                rays_per_image=1024, n_samples=64, n_importance=128, lr=5e-4, white_bkgd=True,
                near=2.0, far=6.0, precrop_epochs=10, precrop_frac=0.5, eval_every=25, seed=3)


def get_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, default=None)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["local_rank"] = args.local_rank
    return argparse.Namespace(**cfg)


class BlenderViews(Dataset):
    def __init__(self, root, split, rays_per_image, white_bkgd=True):
        meta = json.load(open(os.path.join(root, f"transforms_{split}.json")))
        self.imgs, self.poses = [], []
        for fr in meta["frames"]:
            im = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
            im = im[..., :3] * im[..., 3:] + (1 - im[..., 3:]) if white_bkgd else im[..., :3]
            self.imgs.append(torch.from_numpy(im))
            self.poses.append(torch.tensor(fr["transform_matrix"], dtype=torch.float32))
        self.H, self.W = self.imgs[0].shape[:2]
        self.focal = 0.5 * self.W / np.tan(0.5 * meta["camera_angle_x"])
        self.n = rays_per_image
        self.precrop = None

    def __len__(self):
        return len(self.imgs)

    def rays(self, idx, ys, xs):
        c2w = self.poses[idx]
        d = torch.stack([(xs - self.W * 0.5) / self.focal, -(ys - self.H * 0.5) / self.focal, -torch.ones_like(xs)], -1)
        d = d @ c2w[:3, :3].T
        return c2w[:3, 3].expand_as(d), d

    def __getitem__(self, idx):
        H, W = self.H, self.W
        if self.precrop is not None:
            dh, dw = int(H // 2 * self.precrop), int(W // 2 * self.precrop)
            ys = torch.randint(H // 2 - dh, H // 2 + dh, (self.n,))
            xs = torch.randint(W // 2 - dw, W // 2 + dw, (self.n,))
        else:
            ys, xs = torch.randint(0, H, (self.n,)), torch.randint(0, W, (self.n,))
        o, d = self.rays(idx, ys.float(), xs.float())
        return o, d, self.imgs[idx][ys, xs]


def embed(x, L):
    return torch.cat([x] + [fn(2.0 ** i * x) for i in range(L) for fn in (torch.sin, torch.cos)], -1)


class TinyNeRF(nn.Module):
    def __init__(self, W=256):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(63, W), nn.ReLU(), *[l for _ in range(4) for l in (nn.Linear(W, W), nn.ReLU())])
        self.block2 = nn.Sequential(nn.Linear(W + 63, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W + 1))
        self.rgb = nn.Sequential(nn.Linear(W + 27, W // 2), nn.ReLU(), nn.Linear(W // 2, 3), nn.Sigmoid())

    def forward(self, x, d):
        ex = embed(x, 10)
        h = self.block2(torch.cat([self.block1(ex), ex], -1))
        return self.rgb(torch.cat([h[..., 1:], embed(d, 4)], -1)), F.relu(h[..., 0])


class HierarchicalNeRF(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.coarse, self.fine = TinyNeRF(), TinyNeRF()

    @staticmethod
    def volume(net, o, d, z, white):
        p = o[:, None] + d[:, None] * z[..., None]
        rgb, sigma = net(p, F.normalize(d, dim=-1)[:, None].expand_as(p))
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * d.norm(dim=-1, keepdim=True)
        a = 1 - torch.exp(-sigma * delta)
        w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
        out = (w[..., None] * rgb).sum(1)
        return (out + 1 - w.sum(-1, keepdim=True) if white else out), w

    def forward(self, o, d, train=True):
        c = self.cfg
        t = torch.linspace(0, 1, c.n_samples, device=o.device)
        z = (c.near + (c.far - c.near) * t).expand(o.shape[0], -1)
        if train:
            z = z + torch.rand_like(z) * (c.far - c.near) / c.n_samples
        rgb0, w = self.volume(self.coarse, o, d, z, c.white_bkgd)
        with torch.no_grad():
            pdf = (w[:, :-1] + 1e-5) / (w[:, :-1] + 1e-5).sum(-1, keepdim=True)
            cdf = F.pad(pdf.cumsum(-1), (1, 0))
            u = torch.rand(o.shape[0], c.n_importance, device=o.device) if train else \
                torch.linspace(0, 1, c.n_importance, device=o.device).expand(o.shape[0], -1).contiguous()
            idx = torch.searchsorted(cdf, u, right=True).clamp(1, z.shape[1] - 1)
            lo, hi = z.gather(1, idx - 1), z.gather(1, idx)
            clo, chi = cdf.gather(1, idx - 1), cdf.gather(1, idx)
            zf = lo + (u - clo) / (chi - clo).clamp_min(1e-5) * (hi - lo)
            zs, _ = torch.sort(torch.cat([z, zf], -1), -1)
        rgb1, _ = self.volume(self.fine, o, d, zs, c.white_bkgd)
        return rgb0, rgb1


def main():
    cfg = get_config()
    torch.cuda.set_device(cfg.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{cfg.local_rank}")
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)

    train_ds = BlenderViews(cfg.data_root, "train", cfg.rays_per_image, cfg.white_bkgd)
    val_ds = BlenderViews(cfg.data_root, "val", cfg.rays_per_image, cfg.white_bkgd)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_ds, batch_size=max(1, cfg.images_per_step // world), sampler=sampler, num_workers=4, drop_last=True)

    model = DDP(HierarchicalNeRF(cfg).to(device), device_ids=[cfg.local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.1 ** (1.0 / (cfg.epochs * len(loader))))
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"world={world}, {len(train_ds)} train views, {len(loader)} steps/epoch", flush=True)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        train_ds.precrop = cfg.precrop_frac if epoch < cfg.precrop_epochs else None
        model.train()
        tot = torch.zeros(2, device=device)
        for o, d, rgb in loader:
            o, d, rgb = (x.reshape(-1, 3).to(device, non_blocking=True) for x in (o, d, rgb))
            rgb0, rgb1 = model(o, d)
            loss = F.mse_loss(rgb0, rgb) + F.mse_loss(rgb1, rgb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([F.mse_loss(rgb1.detach(), rgb), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch:4d} train psnr {(-10 * torch.log10(tot[0] / tot[1])).item():.2f}", flush=True)

        if (epoch + 1) % cfg.eval_every == 0:
            model.eval()
            acc = torch.zeros(2, device=device)
            H, W = val_ds.H, val_ds.W
            ys, xs = torch.meshgrid(torch.arange(H, dtype=torch.float32), torch.arange(W, dtype=torch.float32), indexing="ij")
            with torch.no_grad():
                for i in range(rank, len(val_ds), world):
                    o, d = val_ds.rays(i, ys.flatten(), xs.flatten())
                    o, d = o.to(device), d.to(device)
                    pred = torch.cat([model.module(o[s:s + 4096], d[s:s + 4096], train=False)[1]
                                      for s in range(0, o.shape[0], 4096)]).view(H, W, 3)
                    acc[0] += -10 * torch.log10(F.mse_loss(pred, val_ds.imgs[i].to(device)))
                    acc[1] += 1
            dist.all_reduce(acc)
            if rank == 0:
                print(f"epoch {epoch:4d} val psnr {(acc[0] / acc[1]).item():.2f} ({int(acc[1])} views)", flush=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                           os.path.join(cfg.out, f"epoch_{epoch + 1:04d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
