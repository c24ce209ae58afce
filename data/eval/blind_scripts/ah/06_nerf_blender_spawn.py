"""NeRF (coarse + fine) on a Blender synthetic scene, data-parallel over all GPUs of one node.

    python train_nerf_ddp.py --datadir data/nerf_synthetic/lego --expname lego_ddp --n_rand 1024

Each process draws its own random rays every step; gradients are averaged by DDP,
so the effective ray batch is n_rand * world_size.
"""
import argparse
import json
import os
import socket

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_blender(basedir, split, half_res=True):
    with open(os.path.join(basedir, f"transforms_{split}.json")) as fp:
        meta = json.load(fp)
    imgs, poses = [], []
    for fr in meta["frames"]:
        img = imageio.imread(os.path.join(basedir, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        if half_res:
            img = img[::2, ::2]
        imgs.append(img)
        poses.append(np.array(fr["transform_matrix"], dtype=np.float32))
    imgs = np.stack(imgs)
    imgs = imgs[..., :3] * imgs[..., 3:] + (1.0 - imgs[..., 3:])  # white background
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / np.tan(0.5 * float(meta["camera_angle_x"]))
    return torch.from_numpy(imgs), torch.from_numpy(np.stack(poses)), (H, W, focal)


def get_rays(H, W, focal, c2w):
    i, j = torch.meshgrid(torch.arange(W, dtype=torch.float32), torch.arange(H, dtype=torch.float32),
                          indexing="xy")
    dirs = torch.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -torch.ones_like(i)], -1)
    rays_d = (dirs[..., None, :] * c2w[:3, :3]).sum(-1)
    rays_o = c2w[:3, -1].expand(rays_d.shape)
    return rays_o, rays_d


class Embedder(nn.Module):
    def __init__(self, n_freqs):
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.arange(n_freqs), persistent=False)
        self.out_dim = 3 + 3 * 2 * n_freqs

    def forward(self, x):
        xf = x[..., None] * self.freqs
        return torch.cat([x, torch.sin(xf).flatten(-2), torch.cos(xf).flatten(-2)], -1)


class NeRFMLP(nn.Module):
    def __init__(self, D=8, W=256, skips=(4,)):
        super().__init__()
        self.emb_x, self.emb_d = Embedder(10), Embedder(4)
        cin = self.emb_x.out_dim
        self.skips = skips
        self.pts = nn.ModuleList([nn.Linear(cin, W)] + [nn.Linear(W + (cin if i in skips else 0), W)
                                                        for i in range(1, D)])
        self.sigma = nn.Linear(W, 1)
        self.feat = nn.Linear(W, W)
        self.rgb = nn.Sequential(nn.Linear(W + self.emb_d.out_dim, W // 2), nn.ReLU(), nn.Linear(W // 2, 3))

    def forward(self, x, d):
        ex, ed = self.emb_x(x), self.emb_d(d)
        h = ex
        for i, l in enumerate(self.pts):
            if i in self.skips:
                h = torch.cat([ex, h], -1)
            h = F.relu(l(h))
        sigma = self.sigma(h)
        rgb = self.rgb(torch.cat([self.feat(h), ed], -1))
        return torch.cat([rgb, sigma], -1)


def raw2outputs(raw, z_vals, rays_d, noise_std=0.0):
    dists = torch.cat([z_vals[..., 1:] - z_vals[..., :-1], torch.full_like(z_vals[..., :1], 1e10)], -1)
    dists = dists * rays_d.norm(dim=-1, keepdim=True)
    rgb = torch.sigmoid(raw[..., :3])
    noise = torch.randn_like(raw[..., 3]) * noise_std if noise_std > 0 else 0.0
    alpha = 1.0 - torch.exp(-F.relu(raw[..., 3] + noise) * dists)
    T = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1.0 - alpha + 1e-10], -1), -1)[..., :-1]
    weights = alpha * T
    rgb_map = (weights[..., None] * rgb).sum(-2)
    acc = weights.sum(-1)
    return rgb_map + (1.0 - acc[..., None]), weights


def sample_pdf(bins, weights, n, det=False):
    pdf = (weights + 1e-5) / (weights + 1e-5).sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[..., :1]), torch.cumsum(pdf, -1)], -1)
    u = torch.linspace(0, 1, n, device=bins.device).expand(*cdf.shape[:-1], n) if det else \
        torch.rand(*cdf.shape[:-1], n, device=bins.device)
    inds = torch.searchsorted(cdf.contiguous(), u.contiguous(), right=True)
    below, above = (inds - 1).clamp(min=0), inds.clamp(max=cdf.shape[-1] - 1)
    g = torch.stack([below, above], -1)
    cdf_g = torch.gather(cdf[..., None, :].expand(*g.shape[:-1], cdf.shape[-1]), -1, g)
    bins_g = torch.gather(bins[..., None, :].expand(*g.shape[:-1], bins.shape[-1]), -1, g)
    denom = torch.where(cdf_g[..., 1] - cdf_g[..., 0] < 1e-5, torch.ones_like(u), cdf_g[..., 1] - cdf_g[..., 0])
    t = (u - cdf_g[..., 0]) / denom
    return bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])


class NeRF(nn.Module):
    def __init__(self, n_coarse=64, n_fine=128, near=2.0, far=6.0):
        super().__init__()
        self.coarse, self.fine = NeRFMLP(), NeRFMLP()
        self.n_coarse, self.n_fine, self.near, self.far = n_coarse, n_fine, near, far

    def forward(self, rays_o, rays_d, perturb=True):
        N = rays_o.shape[0]
        t = torch.linspace(0.0, 1.0, self.n_coarse, device=rays_o.device)
        z = (self.near * (1 - t) + self.far * t).expand(N, -1)
        if perturb:
            mids = 0.5 * (z[:, 1:] + z[:, :-1])
            lo, hi = torch.cat([z[:, :1], mids], -1), torch.cat([mids, z[:, -1:]], -1)
            z = lo + (hi - lo) * torch.rand_like(z)
        viewdirs = F.normalize(rays_d, dim=-1)
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        raw = self.coarse(pts, viewdirs[:, None].expand_as(pts))
        rgb_c, w = raw2outputs(raw, z, rays_d, 1.0 if perturb else 0.0)
        z_mid = 0.5 * (z[:, 1:] + z[:, :-1])
        z_f = sample_pdf(z_mid, w[:, 1:-1], self.n_fine, det=not perturb).detach()
        z_all, _ = torch.sort(torch.cat([z, z_f], -1), -1)
        pts = rays_o[:, None] + rays_d[:, None] * z_all[..., None]
        raw = self.fine(pts, viewdirs[:, None].expand_as(pts))
        rgb_f, _ = raw2outputs(raw, z_all, rays_d, 1.0 if perturb else 0.0)
        return rgb_c, rgb_f


def mse2psnr(x):
    return -10.0 * torch.log10(x)


@torch.no_grad()
def render_image(net, H, W, focal, c2w, device, chunk=4096):
    ro, rd = get_rays(H, W, focal, c2w)
    ro, rd = ro.reshape(-1, 3).to(device), rd.reshape(-1, 3).to(device)
    out = [net(ro[i:i + chunk], rd[i:i + chunk], perturb=False)[1] for i in range(0, ro.shape[0], chunk)]
    return torch.cat(out).view(H, W, 3)


def worker(rank, world_size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    imgs, poses, (H, W, focal) = load_blender(args.datadir, "train")
    test_imgs, test_poses, _ = load_blender(args.datadir, "test")
    rays = torch.stack([torch.stack(get_rays(H, W, focal, p[:3, :4])) for p in poses])  # (N,2,H,W,3)
    rays_rgb = torch.cat([rays, imgs[:, None]], 1).permute(0, 2, 3, 1, 4).reshape(-1, 3, 3).to(device)

    torch.manual_seed(0)  # same initial weights everywhere; DDP also broadcasts them
    net = NeRF().to(device)
    model = DDP(net, device_ids=[rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))

    basedir = os.path.join(args.basedir, args.expname)
    ckpt_path = os.path.join(basedir, "latest.tar")
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["network"])
        optim.load_state_dict(ck["optimizer"])
        start = ck["global_step"]

    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed * 1000 + rank + start)  # distinct rays per rank
    decay_steps = args.lrate_decay * 1000
    for step in range(start, args.n_iters):
        sel = torch.randint(0, rays_rgb.shape[0], (args.n_rand,), device=device, generator=gen)
        batch = rays_rgb[sel]
        rgb_c, rgb_f = model(batch[:, 0], batch[:, 1])
        loss_c, loss_f = F.mse_loss(rgb_c, batch[:, 2]), F.mse_loss(rgb_f, batch[:, 2])
        loss = loss_c + loss_f
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        new_lr = args.lr * (0.1 ** (step / decay_steps))
        for g in optim.param_groups:
            g["lr"] = new_lr

        if step % args.i_print == 0:
            stats = torch.stack([loss.detach(), loss_f.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"[{step}] loss {stats[0]:.5f} psnr {mse2psnr(stats[1]).item():.2f} lr {new_lr:.2e}",
                      flush=True)

        if (step + 1) % args.i_weights == 0:
            if rank == 0:
                os.makedirs(basedir, exist_ok=True)
                torch.save({"global_step": step + 1, "network": net.state_dict(),
                            "optimizer": optim.state_dict()}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

        if (step + 1) % args.i_test == 0:
            net.eval()
            mse_sum = torch.zeros(2, device=device)
            for k in range(rank, len(test_imgs), world_size * args.test_skip):
                pred = render_image(net, H, W, focal, test_poses[k][:3, :4], device)
                mse_sum[0] += F.mse_loss(pred, test_imgs[k].to(device))
                mse_sum[1] += 1
            dist.all_reduce(mse_sum)
            if rank == 0:
                print(f"[{step + 1}] test PSNR {mse2psnr(mse_sum[0] / mse_sum[1]).item():.2f} "
                      f"over {int(mse_sum[1])} views", flush=True)
            net.train()

    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--basedir", default="./logs")
    p.add_argument("--expname", default="lego_ddp")
    p.add_argument("--n_rand", type=int, default=1024)
    p.add_argument("--n_iters", type=int, default=200000)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lrate_decay", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--i_print", type=int, default=100)
    p.add_argument("--i_weights", type=int, default=10000)
    p.add_argument("--i_test", type=int, default=50000)
    p.add_argument("--test_skip", type=int, default=8)
    args = p.parse_args()

    world_size = torch.cuda.device_count()
    port = free_port()
    mp.spawn(worker, args=(world_size, port, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
