#!/usr/bin/env python
# mip-NeRF on LLFF forward-facing scenes (NDC space), multi-GPU with torchrun.
#
#   torchrun --nproc_per_node=4 03_mipnerf_llff.py --datadir data/nerf_llff_data/fern --expname fern_mip
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("mipnerf")


def config():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--expname", required=True)
    p.add_argument("--basedir", default="./logs")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--llffhold", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch_size", type=int, default=4096, help="rays per step, summed over GPUs")
    p.add_argument("--num_samples", type=int, default=128)
    p.add_argument("--lr_init", type=float, default=5e-4)
    p.add_argument("--lr_final", type=float, default=5e-6)
    p.add_argument("--coarse_weight", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=8192)
    return p.parse_args()


def load_llff(basedir, factor):
    pb = np.load(os.path.join(basedir, "poses_bounds.npy"))
    poses = pb[:, :-2].reshape(-1, 3, 5).astype(np.float32)
    bds = pb[:, -2:].astype(np.float32)
    files = sorted(glob.glob(os.path.join(basedir, f"images_{factor}", "*.[pPjJ][nNpP][gG]")))
    imgs = np.stack([imageio.imread(f)[..., :3] / 255.0 for f in files]).astype(np.float32)
    H, W = imgs.shape[1:3]
    focal = poses[0, 2, 4] / factor
    # LLFF [down, right, back] -> [right, up, back]
    poses = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:4]], -1)
    sc = 1.0 / (bds.min() * 0.75)
    poses[:, :3, 3] *= sc
    center = poses[:, :3, 3].mean(0)
    poses[:, :3, 3] -= center
    return imgs, poses[:, :3, :4], H, W, focal


def ndc_rays(H, W, focal, near, rays_o, rays_d):
    t = -(near + rays_o[..., 2]) / rays_d[..., 2]
    rays_o = rays_o + t[..., None] * rays_d
    o0 = -1.0 / (W / (2.0 * focal)) * rays_o[..., 0] / rays_o[..., 2]
    o1 = -1.0 / (H / (2.0 * focal)) * rays_o[..., 1] / rays_o[..., 2]
    o2 = 1.0 + 2.0 * near / rays_o[..., 2]
    d0 = -1.0 / (W / (2.0 * focal)) * (rays_d[..., 0] / rays_d[..., 2] - rays_o[..., 0] / rays_o[..., 2])
    d1 = -1.0 / (H / (2.0 * focal)) * (rays_d[..., 1] / rays_d[..., 2] - rays_o[..., 1] / rays_o[..., 2])
    d2 = -2.0 * near / rays_o[..., 2]
    return torch.stack([o0, o1, o2], -1), torch.stack([d0, d1, d2], -1)


def make_rays(H, W, focal, c2w):
    x, y = torch.meshgrid(torch.arange(W, dtype=torch.float32), torch.arange(H, dtype=torch.float32), indexing="xy")
    dirs = torch.stack([(x - 0.5 * W + 0.5) / focal, -(y - 0.5 * H + 0.5) / focal, -torch.ones_like(x)], -1)
    c2w = torch.from_numpy(c2w)
    rays_d = (dirs[..., None, :] * c2w[:3, :3]).sum(-1)
    rays_o = c2w[:3, 3].expand_as(rays_d)
    rays_o, rays_d = ndc_rays(H, W, focal, 1.0, rays_o, rays_d)
    dx = torch.sqrt(((rays_d[:-1, :, :] - rays_d[1:, :, :]) ** 2).sum(-1))
    dx = torch.cat([dx, dx[-2:-1]], 0)
    radii = dx[..., None] * 2 / np.sqrt(12)
    return rays_o, rays_d, radii


class RayDataset(Dataset):
    def __init__(self, imgs, poses, H, W, focal):
        o, d, r = zip(*[make_rays(H, W, focal, c2w) for c2w in poses])
        self.rays = torch.cat([torch.stack(o), torch.stack(d), torch.stack(r)], -1).reshape(-1, 7)
        self.rgb = torch.from_numpy(imgs).reshape(-1, 3)

    def __len__(self):
        return self.rays.shape[0]

    def __getitem__(self, i):
        return self.rays[i], self.rgb[i]


def conical_frustum(rays_o, rays_d, radii, t):
    t0, t1 = t[..., :-1], t[..., 1:]
    mu, hw = (t0 + t1) / 2, (t1 - t0) / 2
    t_mean = mu + (2 * mu * hw ** 2) / (3 * mu ** 2 + hw ** 2)
    t_var = hw ** 2 / 3 - (4 / 15) * ((hw ** 4 * (12 * mu ** 2 - hw ** 2)) / (3 * mu ** 2 + hw ** 2) ** 2)
    r_var = radii ** 2 * (mu ** 2 / 4 + (5 / 12) * hw ** 2 - 4 / 15 * hw ** 4 / (3 * mu ** 2 + hw ** 2))
    mean = rays_o[..., None, :] + rays_d[..., None, :] * t_mean[..., None]
    d_sq = rays_d ** 2
    null_outer = 1 - d_sq / d_sq.sum(-1, keepdim=True).clamp_min(1e-10)
    cov = t_var[..., None] * d_sq[..., None, :] + r_var[..., None] * null_outer[..., None, :]
    return mean, cov


def integrated_pos_enc(mean, var, min_deg=0, max_deg=16):
    scales = 2.0 ** torch.arange(min_deg, max_deg, device=mean.device)
    y = (mean[..., None, :] * scales[:, None]).flatten(-2)
    y_var = (var[..., None, :] * scales[:, None] ** 2).flatten(-2)
    return torch.cat([torch.exp(-0.5 * y_var) * torch.sin(y), torch.exp(-0.5 * y_var) * torch.cos(y)], -1)


class MipNeRF(nn.Module):
    def __init__(self, num_samples=128, width=256, depth=8):
        super().__init__()
        self.num_samples = num_samples
        self.trunk = nn.ModuleList([nn.Linear(96, width)] + [nn.Linear(width + (96 if i == 5 else 0), width) for i in range(1, depth)])
        self.density = nn.Linear(width, 1)
        self.bottleneck = nn.Linear(width, width)
        self.view = nn.Linear(width + 27, width // 2)
        self.color = nn.Linear(width // 2, 3)

    def mlp(self, enc, dirs_enc):
        h = enc
        for i, layer in enumerate(self.trunk):
            if i == 5:
                h = torch.cat([h, enc], -1)
            h = F.relu(layer(h))
        sigma = F.softplus(self.density(h).squeeze(-1) - 1.0)
        v = F.relu(self.view(torch.cat([self.bottleneck(h), dirs_enc], -1)))
        return torch.sigmoid(self.color(v)) * 1.002 - 0.001, sigma

    def render_level(self, rays, t, randomized):
        o, d, r = rays[:, :3], rays[:, 3:6], rays[:, 6:7]
        mean, cov = conical_frustum(o, d, r, t)
        enc = integrated_pos_enc(mean, cov)
        vd = F.normalize(d, dim=-1)
        denc = torch.cat([vd] + [f(2.0 ** k * vd) for k in range(4) for f in (torch.sin, torch.cos)], -1)
        rgb, sigma = self.mlp(enc, denc[:, None].expand(-1, enc.shape[1], -1))
        delta = (t[:, 1:] - t[:, :-1]) * d.norm(dim=-1, keepdim=True)
        alpha = 1 - torch.exp(-sigma * delta)
        trans = torch.exp(-torch.cat([torch.zeros_like(delta[:, :1]), torch.cumsum(sigma * delta, -1)[:, :-1]], -1))
        w = alpha * trans
        return (w[..., None] * rgb).sum(1), w

    def forward(self, rays, randomized=True):
        n = rays.shape[0]
        t = torch.linspace(0.0, 1.0, self.num_samples + 1, device=rays.device).expand(n, -1)
        if randomized:
            mids = 0.5 * (t[:, 1:] + t[:, :-1])
            lo, hi = torch.cat([t[:, :1], mids], -1), torch.cat([mids, t[:, -1:]], -1)
            t = lo + (hi - lo) * torch.rand_like(t)
        rgb_c, w = self.render_level(rays, t, randomized)
        # resample with blurred weights (mip-NeRF's max-blur filter)
        wp = torch.cat([w[:, :1], w, w[:, -1:]], -1)
        wb = 0.5 * (torch.maximum(wp[:, :-2], wp[:, 1:-1]) + torch.maximum(wp[:, 1:-1], wp[:, 2:])) + 0.01
        pdf = wb / wb.sum(-1, keepdim=True)
        cdf = torch.cat([torch.zeros_like(pdf[:, :1]), torch.cumsum(pdf, -1).clamp(max=1.0)], -1)
        u = torch.rand(n, self.num_samples + 1, device=rays.device) if randomized else \
            torch.linspace(0, 1, self.num_samples + 1, device=rays.device).expand(n, -1).contiguous()
        idx = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[-1] - 1)
        c0, c1 = cdf.gather(-1, idx - 1), cdf.gather(-1, idx)
        b0, b1 = t.gather(-1, idx - 1), t.gather(-1, idx)
        t_f = b0 + (u - c0) / (c1 - c0).clamp_min(1e-5) * (b1 - b0)
        t_f, _ = torch.sort(t_f.detach(), -1)
        rgb_f, _ = self.render_level(rays, t_f, randomized)
        return rgb_c, rgb_f


def main():
    args = config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    device = torch.device("cuda")

    imgs, poses, H, W, focal = load_llff(args.datadir, args.factor)
    test_idx = np.arange(len(imgs))[::args.llffhold]
    train_idx = np.array([i for i in range(len(imgs)) if i not in test_idx])
    train_set = RayDataset(imgs[train_idx], poses[train_idx], H, W, focal)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    total_steps = args.epochs * len(loader)
    log.info("%d train rays, %d steps/epoch on each of %d GPUs", len(train_set), len(loader), world_size)

    model = DDP(MipNeRF(args.num_samples).to(device), device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr_init)
    lr_fn = lambda s: np.exp(np.log(args.lr_init) * (1 - s / total_steps) + np.log(args.lr_final) * s / total_steps) / args.lr_init
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_fn)

    savedir = os.path.join(args.basedir, args.expname)
    if rank == 0:
        os.makedirs(savedir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for rays, rgb in loader:
            rays, rgb = rays.to(device, non_blocking=True), rgb.to(device, non_blocking=True)
            rgb_c, rgb_f = model(rays)
            mse_c, mse_f = F.mse_loss(rgb_c, rgb), F.mse_loss(rgb_f, rgb)
            loss = args.coarse_weight * mse_c + mse_f
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            running += torch.stack([mse_f.detach(), torch.ones((), device=device)])
            if step % 500 == 0:
                dist.all_reduce(running)
                log.info("epoch %d step %d psnr %.2f lr %.2e", epoch, step,
                         -10 * torch.log10(running[0] / running[1]).item(), sched.get_last_lr()[0])
                running.zero_()

        # held-out views, split over ranks; sums reduced so every rank sees the same number
        model.eval()
        sums = torch.zeros(2, device=device)
        with torch.no_grad():
            for i in test_idx[rank::world_size]:
                o, d, r = make_rays(H, W, focal, poses[i])
                rays = torch.cat([o, d, r], -1).reshape(-1, 7).to(device)
                pred = torch.cat([model.module(rays[s:s + args.chunk], randomized=False)[1]
                                  for s in range(0, rays.shape[0], args.chunk)]).view(H, W, 3)
                gt = torch.from_numpy(imgs[i]).to(device)
                sums[0] += -10 * torch.log10(F.mse_loss(pred, gt))
                sums[1] += 1
                if epoch == args.epochs - 1:
                    imageio.imwrite(os.path.join(savedir, f"test_{i:03d}.png"), (pred.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
        dist.all_reduce(sums)
        log.info("epoch %d  test PSNR %.3f over %d views", epoch, (sums[0] / sums[1]).item(), int(sums[1]))

        if rank == 0:
            torch.save({"epoch": epoch, "step": step, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(savedir, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
