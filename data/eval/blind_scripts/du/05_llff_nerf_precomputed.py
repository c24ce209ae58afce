"""Vanilla NeRF (coarse + fine) on LLFF / 360 captures with precomputed ray tables.

Ray origins, directions and colours of all training pixels are computed once
and stored next to the images so that later runs start in seconds.

    torchrun --nproc_per_node=4 05_llff_nerf_precomputed.py --root /data/360_v2/garden --factor 4
"""
import argparse
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def load_poses(root, factor):
    pb = np.load(os.path.join(root, "poses_bounds.npy"))
    poses = pb[:, :15].reshape(-1, 3, 5)
    poses = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:]], 2)
    bounds = pb[:, 15:]
    s = 1.0 / (bounds.min() * 0.75)
    poses[:, :3, 3] *= s
    bounds = bounds * s
    imdir = os.path.join(root, f"images_{factor}")
    names = sorted(os.listdir(imdir))
    return poses, bounds, [os.path.join(imdir, n) for n in names], poses[0, 2, 4] / factor


class RayTable(Dataset):
    def __init__(self, root, factor, hold=8):
        poses, bounds, files, focal = load_poses(root, factor)
        self.train_ids = [i for i in range(len(files)) if i % hold != 0]
        self.test_ids = [i for i in range(len(files)) if i % hold == 0]
        self.poses, self.bounds, self.files, self.focal = poses, bounds, files, focal
        self.near, self.far = float(bounds.min() * 0.9), float(bounds.max())

        cache = os.path.join(root, f"raycache_f{factor}_h{hold}.npy")
        if os.path.exists(cache):
            table = np.load(cache, mmap_mode="r")
        else:
            rows = []
            for i in self.train_ids:
                img = imageio.imread(files[i])[..., :3].astype(np.float32) / 255.0
                o, d = self.rays_for(i, *img.shape[:2])
                rows.append(np.concatenate([o, d, img], -1).reshape(-1, 9))
            table = np.concatenate(rows).astype(np.float32)
            np.save(cache, table)
            del rows, table
            table = np.load(cache, mmap_mode="r")
        self.table = table

    def rays_for(self, i, H, W):
        x, y = np.meshgrid(np.arange(W) + 0.5, np.arange(H) + 0.5, indexing="xy")
        d = np.stack([(x - W / 2) / self.focal, -(y - H / 2) / self.focal, -np.ones_like(x)], -1)
        d = d @ self.poses[i, :3, :3].T
        o = np.broadcast_to(self.poses[i, :3, 3], d.shape)
        return o.astype(np.float32), d.astype(np.float32)

    def __len__(self):
        return self.table.shape[0]

    def __getitem__(self, k):
        return torch.from_numpy(np.array(self.table[k]))


class MLP(nn.Module):
    def __init__(self, D=8, W=256, L_x=10, L_d=4):
        super().__init__()
        self.L_x, self.L_d = L_x, L_d
        dx, dd = 3 + 6 * L_x, 3 + 6 * L_d
        self.pts = nn.ModuleList([nn.Linear(dx, W)] + [nn.Linear(W + dx if i == 4 else W, W) for i in range(1, D)])
        self.sigma = nn.Linear(W, 1)
        self.bottleneck = nn.Linear(W, W)
        self.view = nn.Linear(W + dd, W // 2)
        self.rgb = nn.Linear(W // 2, 3)

    @staticmethod
    def pe(x, L):
        f = (2.0 ** torch.arange(L, device=x.device)) * math.pi
        xf = (x[..., None] * f).flatten(-2)
        return torch.cat([x, xf.sin(), xf.cos()], -1)

    def forward(self, x, d):
        ex, ed = self.pe(x, self.L_x), self.pe(d, self.L_d)
        h = ex
        for i, l in enumerate(self.pts):
            if i == 4:
                h = torch.cat([ex, h], -1)
            h = F.relu(l(h))
        sigma = self.sigma(h).squeeze(-1)
        h = F.relu(self.view(torch.cat([self.bottleneck(h), ed], -1)))
        return torch.sigmoid(self.rgb(h)), sigma


class NeRF(nn.Module):
    def __init__(self, n_coarse=64, n_fine=128):
        super().__init__()
        self.coarse, self.fine = MLP(), MLP()
        self.n_coarse, self.n_fine = n_coarse, n_fine

    @staticmethod
    def composite(rgb, sigma, z, rays_d):
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-F.relu(sigma) * delta * rays_d.norm(dim=-1, keepdim=True))
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), w

    def forward(self, rays_o, rays_d, near, far, perturb=True):
        t = torch.linspace(0, 1, self.n_coarse, device=rays_o.device)
        z = (near * (1 - t) + far * t).expand(rays_o.shape[0], -1)
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (far - near) / self.n_coarse
        d_unit = F.normalize(rays_d, dim=-1)
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        rgb_c, w = self.composite(*self.coarse(pts, d_unit[:, None].expand_as(pts)), z, rays_d)
        # importance sampling from the coarse weights
        pdf = (w[:, 1:-1] + 1e-5).detach()
        pdf = pdf / pdf.sum(-1, keepdim=True)
        cdf = torch.cat([torch.zeros_like(pdf[:, :1]), torch.cumsum(pdf, -1)], -1)
        u = torch.rand(rays_o.shape[0], self.n_fine, device=rays_o.device) if perturb else \
            torch.linspace(0, 1, self.n_fine, device=rays_o.device).expand(rays_o.shape[0], -1).contiguous()
        ids = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[-1] - 1)
        mids = 0.5 * (z[:, 1:] + z[:, :-1])
        c0, c1 = cdf.gather(1, ids - 1), cdf.gather(1, ids)
        b0, b1 = mids.gather(1, ids - 1), mids.gather(1, ids.clamp(max=mids.shape[1] - 1))
        z_f = b0 + (u - c0) / (c1 - c0).clamp_min(1e-5) * (b1 - b0)
        z_all, _ = torch.sort(torch.cat([z, z_f.detach()], -1), -1)
        pts = rays_o[:, None] + rays_d[:, None] * z_all[..., None]
        rgb_f, _ = self.composite(*self.fine(pts, d_unit[:, None].expand_as(pts)), z_all, rays_d)
        return rgb_c, rgb_f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--logdir", default="logs/nerf")
    ap.add_argument("--epochs", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=4096, help="global ray batch")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    ds = RayTable(args.root, args.factor)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler,
                    num_workers=args.workers, pin_memory=True, drop_last=True)

    model = DDP(NeRF().to(dev), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.1 ** (s / total))
    tb = SummaryWriter(args.logdir) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in dl:
            batch = batch.to(dev, non_blocking=True)
            rays_o, rays_d, rgb = batch[:, :3], batch[:, 3:6], batch[:, 6:]
            rgb_c, rgb_f = model(rays_o, rays_d, ds.near, ds.far)
            loss = F.mse_loss(rgb_c, rgb) + F.mse_loss(rgb_f, rgb)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                mse_f = F.mse_loss(rgb_f.detach(), rgb)
                dist.all_reduce(mse_f)
                if rank == 0:
                    mse_f = mse_f.item() / world
                    tb.add_scalar("train/psnr_fine", -10 * math.log10(mse_f), step)
                    tb.add_scalar("train/lr", sched.get_last_lr()[0], step)

        # evaluation: test views split over ranks, PSNR sums reduced
        model.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for i in ds.test_ids[rank::world]:
                gt = torch.from_numpy(imageio.imread(ds.files[i])[..., :3].astype(np.float32) / 255.0).to(dev)
                o, d = ds.rays_for(i, *gt.shape[:2])
                o, d = torch.from_numpy(o).to(dev).reshape(-1, 3), torch.from_numpy(d).to(dev).reshape(-1, 3)
                out = torch.cat([model.module(o[s:s + 8192], d[s:s + 8192], ds.near, ds.far, perturb=False)[1]
                                 for s in range(0, o.shape[0], 8192)])
                mse = F.mse_loss(out.reshape(gt.shape), gt)
                acc[0] += -10 * torch.log10(mse)
                acc[1] += 1
        dist.all_reduce(acc)
        model.train()
        if rank == 0:
            tb.add_scalar("test/psnr", (acc[0] / acc[1]).item(), epoch)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optim": optim.state_dict()},
                       os.path.join(args.logdir, "ckpt.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
