#!/usr/bin/env python3
# Forward-facing (LLFF) NeRF with NDC rays, trained with DDP over shuffled ray batches.
#
#   torchrun --nproc_per_node=4 train_llff.py --datadir data/nerf_llff_data/fern --factor 4
#
import argparse
import glob
import logging
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("llff")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--outdir", default="out/llff")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--llffhold", type=int, default=8)
    p.add_argument("--batch", type=int, default=4096, help="global rays per step")
    p.add_argument("--n_samples", type=int, default=64)
    p.add_argument("--n_importance", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ckpt_every", type=int, default=5)
    return p.parse_args()


def normalize(v):
    return v / np.linalg.norm(v)


def poses_avg(poses):
    center = poses[:, :3, 3].mean(0)
    z = normalize(poses[:, :3, 2].sum(0))
    up = poses[:, :3, 1].sum(0)
    x = normalize(np.cross(up, z))
    y = np.cross(z, x)
    return np.stack([x, y, z, center], 1)


def recenter(poses):
    c2w = np.eye(4)
    c2w[:3] = poses_avg(poses)
    bottom = np.tile(np.array([0, 0, 0, 1.0]), (poses.shape[0], 1, 1))
    p = np.concatenate([poses[:, :3, :4], bottom], 1)
    return (np.linalg.inv(c2w) @ p)[:, :3, :4]


def load_llff(datadir, factor):
    pb = np.load(os.path.join(datadir, "poses_bounds.npy"))
    poses = pb[:, :-2].reshape(-1, 3, 5)
    bds = pb[:, -2:]
    img_dir = os.path.join(datadir, f"images_{factor}" if factor > 1 else "images")
    files = sorted(f for f in glob.glob(os.path.join(img_dir, "*")) if f.lower().endswith(("png", "jpg")))
    imgs = np.stack([imageio.imread(f)[..., :3] / 255.0 for f in files]).astype(np.float32)
    H, W, focal = poses[0, :, 4]
    H, W, focal = imgs.shape[1], imgs.shape[2], focal / factor
    # LLFF stores [down, right, back]; convert to [right, up, back]
    poses = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:4]], 2)
    sc = 1.0 / (bds.min() * 0.75)
    poses[:, :3, 3] *= sc
    poses = recenter(poses).astype(np.float32)
    return imgs, poses, int(H), int(W), float(focal)


def ndc_rays(H, W, focal, near, rays_o, rays_d):
    t = -(near + rays_o[..., 2]) / rays_d[..., 2]
    rays_o = rays_o + t[..., None] * rays_d
    o0 = -1.0 / (W / (2.0 * focal)) * rays_o[..., 0] / rays_o[..., 2]
    o1 = -1.0 / (H / (2.0 * focal)) * rays_o[..., 1] / rays_o[..., 2]
    o2 = 1.0 + 2.0 * near / rays_o[..., 2]
    d0 = -1.0 / (W / (2.0 * focal)) * (rays_d[..., 0] / rays_d[..., 2] - rays_o[..., 0] / rays_o[..., 2])
    d1 = -1.0 / (H / (2.0 * focal)) * (rays_d[..., 1] / rays_d[..., 2] - rays_o[..., 1] / rays_o[..., 2])
    d2 = -2.0 * near / rays_o[..., 2]
    return np.stack([o0, o1, o2], -1), np.stack([d0, d1, d2], -1)


def image_rays(H, W, focal, c2w):
    i, j = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing="xy")
    dirs = np.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -np.ones_like(i)], -1)
    rd = (dirs[..., None, :] * c2w[:3, :3]).sum(-1)
    ro = np.broadcast_to(c2w[:3, 3], rd.shape)
    ro, rd = ndc_rays(H, W, focal, 1.0, ro, rd)
    return np.concatenate([ro, rd, rd / np.linalg.norm(rd, axis=-1, keepdims=True)], -1)


def get_ray_tensors(args):
    cache = os.path.join(args.datadir, f"rays_f{args.factor}_hold{args.llffhold}.npz")
    if os.path.exists(cache):
        log.info("loading cached rays from %s", cache)
        z = np.load(cache)
        return z["train_rays"], z["train_rgb"], z["test_rays"], z["test_rgb"], tuple(z["hw"])
    imgs, poses, H, W, focal = load_llff(args.datadir, args.factor)
    test_ids = np.arange(len(imgs))[::args.llffhold]
    train_ids = np.array([i for i in range(len(imgs)) if i not in test_ids])
    rays = np.stack([image_rays(H, W, focal, p) for p in poses]).astype(np.float32)
    out = dict(train_rays=rays[train_ids].reshape(-1, 9), train_rgb=imgs[train_ids].reshape(-1, 3),
               test_rays=rays[test_ids], test_rgb=imgs[test_ids], hw=np.array([H, W]))
    np.savez(cache, **out)
    log.info("wrote %s (%d training rays)", cache, out["train_rays"].shape[0])
    return out["train_rays"], out["train_rgb"], out["test_rays"], out["test_rgb"], (H, W)


class PE(nn.Module):
    def __init__(self, L):
        super().__init__()
        self.register_buffer("f", (2.0 ** torch.arange(L)) * np.pi, persistent=False)

    def forward(self, x):
        y = (x[..., None] * self.f).flatten(-2)
        return torch.cat([x, y.sin(), y.cos()], -1)


class Field(nn.Module):
    def __init__(self, W=256):
        super().__init__()
        self.pe_x, self.pe_d = PE(10), PE(4)
        self.trunk1 = nn.Sequential(nn.Linear(63, W), nn.ReLU(), *[m for _ in range(3) for m in (nn.Linear(W, W), nn.ReLU())])
        self.trunk2 = nn.Sequential(nn.Linear(W + 63, W), nn.ReLU(), *[m for _ in range(3) for m in (nn.Linear(W, W), nn.ReLU())])
        self.sigma = nn.Linear(W, 1)
        self.bottleneck = nn.Linear(W, W)
        self.head = nn.Sequential(nn.Linear(W + 27, W // 2), nn.ReLU(), nn.Linear(W // 2, 3), nn.Sigmoid())

    def forward(self, x, d):
        ex = self.pe_x(x)
        h = self.trunk1(ex)
        h = self.trunk2(torch.cat([h, ex], -1))
        d = self.pe_d(d).expand(*h.shape[:-1], -1)
        return self.head(torch.cat([self.bottleneck(h), d], -1)), self.sigma(h)[..., 0]


class Renderer(nn.Module):
    def __init__(self, n_s, n_i):
        super().__init__()
        self.coarse, self.fine = Field(), Field()
        self.n_s, self.n_i = n_s, n_i

    @staticmethod
    def composite(rgb, sigma, z, rd):
        delta = torch.cat([z[:, 1:] - z[:, :-1], 1e10 * torch.ones_like(z[:, :1])], -1) * rd.norm(dim=-1, keepdim=True)
        a = 1.0 - torch.exp(-F.relu(sigma + torch.randn_like(sigma) * (1.0 if rgb.requires_grad else 0.0)) * delta)
        w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1.0 - a + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), w

    def forward(self, rays):
        ro, rd, vd = rays[:, :3], rays[:, 3:6], rays[:, 6:9]
        z = torch.linspace(0, 1, self.n_s, device=rays.device).expand(rays.shape[0], -1)
        if self.training:
            z = z + torch.rand_like(z) / self.n_s
        rgb, sig = self.coarse(ro[:, None] + rd[:, None] * z[..., None], vd[:, None])
        c_rgb, w = self.composite(rgb, sig, z, rd)
        with torch.no_grad():
            pdf = w[:, 1:-1] + 1e-5
            cdf = F.pad(torch.cumsum(pdf / pdf.sum(-1, keepdim=True), -1), (1, 0))
            u = torch.rand(cdf.shape[0], self.n_i, device=rays.device) if self.training else \
                torch.linspace(0, 1, self.n_i, device=rays.device).expand(cdf.shape[0], -1).contiguous()
            idx = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[1] - 1)
            mid = 0.5 * (z[:, 1:] + z[:, :-1])
            c0, c1 = cdf.gather(1, idx - 1), cdf.gather(1, idx)
            b0, b1 = mid.gather(1, idx - 1), mid.gather(1, idx)
            zf = b0 + (u - c0) / (c1 - c0).clamp_min(1e-5) * (b1 - b0)
            z_all = torch.sort(torch.cat([z, zf], -1), -1).values
        rgb, sig = self.fine(ro[:, None] + rd[:, None] * z_all[..., None], vd[:, None])
        f_rgb, _ = self.composite(rgb, sig, z_all, rd)
        return c_rgb, f_rgb


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    dev = torch.device("cuda", local_rank)

    train_rays, train_rgb, test_rays, test_rgb, (H, W) = get_ray_tensors(args)
    ds = TensorDataset(torch.from_numpy(train_rays), torch.from_numpy(train_rgb))
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.batch // world, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    net = Renderer(args.n_samples, args.n_importance).to(dev)
    net = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 ** (s / total))
    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)

    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        net.train()
        running = torch.zeros(2, device=dev)
        for rays, rgb in loader:
            rays, rgb = rays.to(dev, non_blocking=True), rgb.to(dev, non_blocking=True)
            c, f = net(rays)
            loss = F.mse_loss(c, rgb) + F.mse_loss(f, rgb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += torch.stack([F.mse_loss(f.detach(), rgb), torch.ones((), device=dev)])
        dist.all_reduce(running)
        log.info("epoch %d  train PSNR %.2f", ep, -10 * torch.log10(running[0] / running[1]).item())

        if (ep + 1) % args.ckpt_every == 0 or ep == args.epochs - 1:
            # held-out views: one image per rank at a time, errors summed over ranks
            net.eval()
            err = torch.zeros(2, device=dev)
            with torch.no_grad():
                for k in range(rank, test_rays.shape[0], world):
                    r = torch.from_numpy(test_rays[k].reshape(-1, 9)).to(dev)
                    pred = torch.cat([net.module(r[s:s + 8192])[1] for s in range(0, r.shape[0], 8192)])
                    gt = torch.from_numpy(test_rgb[k].reshape(-1, 3)).to(dev)
                    err += torch.stack([-10 * torch.log10(F.mse_loss(pred, gt)), torch.ones((), device=dev)])
            dist.all_reduce(err)
            if rank == 0:
                log.info("epoch %d  test PSNR %.2f over %d views", ep, (err[0] / err[1]).item(), int(err[1]))
                torch.save({"epoch": ep, "model": net.module.state_dict(), "opt": opt.state_dict()},
                           os.path.join(args.outdir, f"ep{ep:03d}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
