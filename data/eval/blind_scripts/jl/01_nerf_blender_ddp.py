#!/usr/bin/env python3
"""Vanilla NeRF (coarse + fine) on the Blender synthetic scenes, data parallel.

    torchrun --nproc_per_node=4 01_nerf_blender_ddp.py \
        --data_dir data/nerf_synthetic/lego --exp lego_ddp --half_res
"""
import argparse
import json
import math
import os
import time

import imageio.v2 as imageio
import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--exp", default="nerf")
    p.add_argument("--out_dir", default="runs")
    p.add_argument("--iters", type=int, default=200_000)
    p.add_argument("--batch_rays", type=int, default=4096, help="global rays per step")
    p.add_argument("--n_coarse", type=int, default=64)
    p.add_argument("--n_fine", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lr_final", type=float, default=5e-5)
    p.add_argument("--half_res", action="store_true")
    p.add_argument("--near", type=float, default=2.0)
    p.add_argument("--far", type=float, default=6.0)
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=25_000)
    p.add_argument("--save_every", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_blender(root, split, half_res):
    with open(os.path.join(root, f"transforms_{split}.json")) as f:
        meta = json.load(f)
    imgs, poses = [], []
    for frame in meta["frames"]:
        img = imageio.imread(os.path.join(root, frame["file_path"] + ".png"))
        img = torch.from_numpy(img.astype(np.float32) / 255.0)
        if half_res:
            img = F.interpolate(img.permute(2, 0, 1)[None], scale_factor=0.5, mode="area")[0].permute(1, 2, 0)
        imgs.append(img)
        poses.append(torch.tensor(frame["transform_matrix"], dtype=torch.float32))
    imgs = torch.stack(imgs)
    imgs = imgs[..., :3] * imgs[..., 3:] + (1.0 - imgs[..., 3:])  # white background
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / math.tan(0.5 * float(meta["camera_angle_x"]))
    return imgs, torch.stack(poses), H, W, focal


def get_rays(H, W, focal, c2w):
    i, j = torch.meshgrid(torch.arange(W, dtype=torch.float32), torch.arange(H, dtype=torch.float32), indexing="xy")
    dirs = torch.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -torch.ones_like(i)], -1)
    rays_d = (dirs[..., None, :] * c2w[:3, :3]).sum(-1)
    rays_o = c2w[:3, 3].expand(rays_d.shape)
    return rays_o, rays_d


class Embedder:
    def __init__(self, n_freqs):
        self.freqs = [2.0 ** k for k in range(n_freqs)]
        self.out_dim = 3 + 6 * n_freqs

    def __call__(self, x):
        out = [x]
        for f in self.freqs:
            out += [torch.sin(f * x), torch.cos(f * x)]
        return torch.cat(out, -1)


class NeRFMLP(nn.Module):
    def __init__(self, depth=8, width=256, pe_xyz=10, pe_dir=4, skips=(4,)):
        super().__init__()
        self.embed_xyz, self.embed_dir = Embedder(pe_xyz), Embedder(pe_dir)
        cx, cd = self.embed_xyz.out_dim, self.embed_dir.out_dim
        self.skips = skips
        self.pts_linears = nn.ModuleList(
            [nn.Linear(cx, width)] + [nn.Linear(width + (cx if i in skips else 0), width) for i in range(1, depth)]
        )
        self.sigma_head = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.rgb_hidden = nn.Linear(width + cd, width // 2)
        self.rgb_head = nn.Linear(width // 2, 3)

    def forward(self, x, d):
        ex, ed = self.embed_xyz(x), self.embed_dir(d)
        h = ex
        for i, layer in enumerate(self.pts_linears):
            if i in self.skips:
                h = torch.cat([ex, h], -1)
            h = F.relu(layer(h))
        sigma = self.sigma_head(h).squeeze(-1)
        h = F.relu(self.rgb_hidden(torch.cat([self.feature(h), ed], -1)))
        return torch.sigmoid(self.rgb_head(h)), sigma


def sample_pdf(bins, weights, n, det):
    weights = weights + 1e-5
    pdf = weights / weights.sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[..., :1]), torch.cumsum(pdf, -1)], -1)
    if det:
        u = torch.linspace(0.0, 1.0, n, device=bins.device).expand(*cdf.shape[:-1], n).contiguous()
    else:
        u = torch.rand(*cdf.shape[:-1], n, device=bins.device)
    inds = torch.searchsorted(cdf, u, right=True)
    g = torch.stack([(inds - 1).clamp(min=0), inds.clamp(max=cdf.shape[-1] - 1)], -1)
    shape = [*g.shape[:-1], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(-2).expand(shape), -1, g)
    bins_g = torch.gather(bins.unsqueeze(-2).expand(shape), -1, g)
    denom = cdf_g[..., 1] - cdf_g[..., 0]
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    return bins_g[..., 0] + (u - cdf_g[..., 0]) / denom * (bins_g[..., 1] - bins_g[..., 0])


def composite(net, rays_o, rays_d, z):
    pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
    dirs = F.normalize(rays_d, dim=-1)[:, None].expand_as(pts)
    rgb, sigma = net(pts.reshape(-1, 3), dirs.reshape(-1, 3))
    rgb, sigma = rgb.view(*pts.shape[:2], 3), sigma.view(pts.shape[:2])
    deltas = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * rays_d.norm(dim=-1, keepdim=True)
    alpha = 1.0 - torch.exp(-F.relu(sigma) * deltas)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
    weights = alpha * trans
    rgb_map = (weights[..., None] * rgb).sum(1) + (1.0 - weights.sum(-1, keepdim=True))
    return rgb_map, weights


class NeRF(nn.Module):
    def __init__(self, near, far, n_coarse, n_fine):
        super().__init__()
        self.near, self.far, self.n_coarse, self.n_fine = near, far, n_coarse, n_fine
        self.coarse = NeRFMLP()
        self.fine = NeRFMLP()

    def forward(self, rays_o, rays_d, perturb=True):
        t = torch.linspace(0.0, 1.0, self.n_coarse, device=rays_o.device)
        z = (self.near * (1.0 - t) + self.far * t).expand(rays_o.shape[0], -1)
        if perturb:
            mids = 0.5 * (z[:, 1:] + z[:, :-1])
            lo, hi = torch.cat([z[:, :1], mids], -1), torch.cat([mids, z[:, -1:]], -1)
            z = lo + (hi - lo) * torch.rand_like(z)
        rgb_c, w = composite(self.coarse, rays_o, rays_d, z)
        z_fine = sample_pdf(0.5 * (z[:, 1:] + z[:, :-1]), w[:, 1:-1].detach(), self.n_fine, det=not perturb)
        z_all, _ = torch.sort(torch.cat([z, z_fine.detach()], -1), -1)
        rgb_f, _ = composite(self.fine, rays_o, rays_d, z_all)
        return rgb_c, rgb_f


def mse2psnr(mse):
    return -10.0 * math.log10(max(mse, 1e-10))


@torch.no_grad()
def render_image(net, rays_o, rays_d, chunk):
    out = []
    for s in range(0, rays_o.shape[0], chunk):
        out.append(net(rays_o[s:s + chunk], rays_d[s:s + chunk], perturb=False)[1])
    return torch.cat(out)


def main():
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    exp_dir = os.path.join(args.out_dir, args.exp)
    writer = None
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
        writer = SummaryWriter(exp_dir)

    imgs, poses, H, W, focal = load_blender(args.data_dir, "train", args.half_res)
    rays = [get_rays(H, W, focal, c2w) for c2w in poses]
    all_o = torch.cat([r[0].reshape(-1, 3) for r in rays]).to(device)
    all_d = torch.cat([r[1].reshape(-1, 3) for r in rays]).to(device)
    all_rgb = imgs.reshape(-1, 3).to(device)
    n_rays = all_o.shape[0]
    rays_per_gpu = args.batch_rays // world
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1000 + rank)

    test_imgs, test_poses, _, _, _ = load_blender(args.data_dir, "test", args.half_res)
    test_ids = list(range(0, len(test_imgs), 8))[rank::world]

    model = NeRF(args.near, args.far, args.n_coarse, args.n_fine).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    gamma = (args.lr_final / args.lr) ** (1.0 / args.iters)
    sched = torch.optim.lr_scheduler.ExponentialLR(optim, gamma)
    lpips_fn = lpips.LPIPS(net="vgg").to(device).eval()

    start = 0
    ckpt_path = os.path.join(exp_dir, "latest.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start = ckpt["step"]

    t0 = time.time()
    for step in range(start + 1, args.iters + 1):
        idx = torch.randint(0, n_rays, (rays_per_gpu,), generator=gen, device=device)
        rgb_c, rgb_f = model(all_o[idx], all_d[idx])
        target = all_rgb[idx]
        loss = F.mse_loss(rgb_c, target) + F.mse_loss(rgb_f, target)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if step % args.log_every == 0:
            stats = torch.stack([loss.detach(), F.mse_loss(rgb_f.detach(), target)])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/loss", stats[0].item(), step)
                writer.add_scalar("train/psnr", mse2psnr(stats[1].item()), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"[{step:>7d}] loss {stats[0].item():.5f} psnr {mse2psnr(stats[1].item()):.2f} "
                      f"({(time.time() - t0) / args.log_every:.3f}s/it)", flush=True)
                t0 = time.time()

        if step % args.eval_every == 0 or step == args.iters:
            model.eval()
            psnrs, lpipss = [], []
            for i in test_ids:
                ro, rd = get_rays(H, W, focal, test_poses[i])
                pred = render_image(model.module, ro.reshape(-1, 3).to(device), rd.reshape(-1, 3).to(device), args.chunk)
                pred = pred.view(H, W, 3).clamp(0, 1)
                gt = test_imgs[i].to(device)
                psnrs.append(mse2psnr(F.mse_loss(pred, gt).item()))
                lp = lpips_fn(pred.permute(2, 0, 1)[None] * 2 - 1, gt.permute(2, 0, 1)[None] * 2 - 1)
                lpipss.append(lp.item())
                os.makedirs(os.path.join(exp_dir, f"test_{step}"), exist_ok=True)
                imageio.imwrite(os.path.join(exp_dir, f"test_{step}", f"r_{i:03d}.png"),
                                (pred.cpu().numpy() * 255).astype(np.uint8))
            model.train()
            mean_psnr = float(np.mean(psnrs))
            mean_lpips = float(np.mean(lpipss))
            if rank == 0:
                writer.add_scalar("test/psnr", mean_psnr, step)
                writer.add_scalar("test/lpips", mean_lpips, step)
                print(f"[{step:>7d}] test PSNR {mean_psnr:.2f}  LPIPS {mean_lpips:.4f}", flush=True)

        if step % args.save_every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "step": step}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

    if rank == 0:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
