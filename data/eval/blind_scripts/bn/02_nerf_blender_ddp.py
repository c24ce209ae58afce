"""
Vanilla NeRF (coarse + fine) on the Blender synthetic scenes, data parallel over rays.

Each rank draws its own random rays every iteration, so no DistributedSampler is
needed; N_rand is the global ray batch and is split over the ranks.

    torchrun --standalone --nproc_per_node=4 train_nerf.py --datadir data/nerf_synthetic/lego \
        --expname lego_ddp --N_rand 4096
"""
import argparse
import datetime
import json
import os
import time

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--expname", required=True)
    p.add_argument("--basedir", default="./logs")
    p.add_argument("--N_rand", type=int, default=4096, help="rays per step, all GPUs together")
    p.add_argument("--N_samples", type=int, default=64)
    p.add_argument("--N_importance", type=int, default=128)
    p.add_argument("--lrate", type=float, default=5e-4)
    p.add_argument("--lrate_decay", type=int, default=500, help="in 1000 steps")
    p.add_argument("--N_iters", type=int, default=200000)
    p.add_argument("--chunk", type=int, default=32768)
    p.add_argument("--half_res", action="store_true")
    p.add_argument("--white_bkgd", action="store_true", default=True)
    p.add_argument("--i_print", type=int, default=100)
    p.add_argument("--i_weights", type=int, default=10000)
    p.add_argument("--i_testset", type=int, default=50000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_blender(basedir, split, half_res):
    with open(os.path.join(basedir, f"transforms_{split}.json")) as f:
        meta = json.load(f)
    imgs, poses = [], []
    for frame in meta["frames"]:
        img = imageio.imread(os.path.join(basedir, frame["file_path"] + ".png"))
        imgs.append(img)
        poses.append(np.array(frame["transform_matrix"], dtype=np.float32))
    imgs = (np.stack(imgs) / 255.0).astype(np.float32)
    poses = np.stack(poses)
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / np.tan(0.5 * float(meta["camera_angle_x"]))
    if half_res:
        H, W, focal = H // 2, W // 2, focal / 2.0
        imgs = F.interpolate(torch.from_numpy(imgs).permute(0, 3, 1, 2), size=(H, W), mode="area")
        imgs = imgs.permute(0, 2, 3, 1).numpy()
    return imgs, poses, H, W, focal


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

    def forward(self, x):
        xf = x[..., None] * self.freqs
        return torch.cat([x, torch.sin(xf).flatten(-2), torch.cos(xf).flatten(-2)], -1)


class NeRFMLP(nn.Module):
    def __init__(self, D=8, W=256, in_pts=63, in_dir=27, skips=(4,)):
        super().__init__()
        self.skips = skips
        self.pts_linears = nn.ModuleList(
            [nn.Linear(in_pts, W)] + [nn.Linear(W + (in_pts if i in skips else 0), W) for i in range(1, D)])
        self.alpha = nn.Linear(W, 1)
        self.feature = nn.Linear(W, W)
        self.views = nn.Linear(W + in_dir, W // 2)
        self.rgb = nn.Linear(W // 2, 3)

    def forward(self, pts, dirs):
        h = pts
        for i, l in enumerate(self.pts_linears):
            if i in self.skips:
                h = torch.cat([pts, h], -1)
            h = F.relu(l(h))
        sigma = self.alpha(h)
        h = F.relu(self.views(torch.cat([self.feature(h), dirs], -1)))
        return torch.cat([torch.sigmoid(self.rgb(h)), sigma], -1)


class NeRF(nn.Module):
    """Coarse and fine networks in one module so DDP syncs both."""

    def __init__(self, N_samples, N_importance, white_bkgd):
        super().__init__()
        self.embed_pts, self.embed_dir = Embedder(10), Embedder(4)
        self.coarse, self.fine = NeRFMLP(), NeRFMLP()
        self.N_samples, self.N_importance, self.white_bkgd = N_samples, N_importance, white_bkgd

    def _composite(self, raw, z_vals, rays_d):
        dists = torch.cat([z_vals[..., 1:] - z_vals[..., :-1], torch.full_like(z_vals[..., :1], 1e10)], -1)
        dists = dists * rays_d.norm(dim=-1, keepdim=True)
        alpha = 1.0 - torch.exp(-F.relu(raw[..., 3]) * dists)
        T = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1.0 - alpha + 1e-10], -1), -1)[..., :-1]
        weights = alpha * T
        rgb = (weights[..., None] * raw[..., :3]).sum(-2)
        if self.white_bkgd:
            rgb = rgb + (1.0 - weights.sum(-1, keepdim=True))
        return rgb, weights

    def _run(self, net, rays_o, rays_d, z_vals):
        pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
        viewdirs = F.normalize(rays_d, dim=-1)[:, None].expand(pts.shape)
        raw = net(self.embed_pts(pts), self.embed_dir(viewdirs))
        return self._composite(raw, z_vals, rays_d)

    def forward(self, rays_o, rays_d, near=2.0, far=6.0, perturb=True):
        t = torch.linspace(0.0, 1.0, self.N_samples, device=rays_o.device)
        z_vals = (near * (1.0 - t) + far * t).expand(rays_o.shape[0], self.N_samples)
        if perturb:
            mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
            upper = torch.cat([mids, z_vals[..., -1:]], -1)
            lower = torch.cat([z_vals[..., :1], mids], -1)
            z_vals = lower + (upper - lower) * torch.rand_like(z_vals)
        rgb0, weights = self._run(self.coarse, rays_o, rays_d, z_vals)
        mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
        pdf = weights[..., 1:-1].detach() + 1e-5
        cdf = torch.cumsum(pdf / pdf.sum(-1, keepdim=True), -1)
        cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], -1)
        u = torch.rand(cdf.shape[0], self.N_importance, device=cdf.device) if perturb else \
            torch.linspace(0.0, 1.0, self.N_importance, device=cdf.device).expand(cdf.shape[0], -1).contiguous()
        inds = torch.searchsorted(cdf, u, right=True)
        below, above = (inds - 1).clamp(min=0), inds.clamp(max=cdf.shape[-1] - 1)
        cdf_g0, cdf_g1 = torch.gather(cdf, 1, below), torch.gather(cdf, 1, above)
        bin_g0, bin_g1 = torch.gather(mids, 1, below), torch.gather(mids, 1, above)
        denom = torch.where(cdf_g1 - cdf_g0 < 1e-5, torch.ones_like(cdf_g0), cdf_g1 - cdf_g0)
        z_samples = (bin_g0 + (u - cdf_g0) / denom * (bin_g1 - bin_g0)).detach()
        z_all, _ = torch.sort(torch.cat([z_vals, z_samples], -1), -1)
        rgb1, _ = self._run(self.fine, rays_o, rays_d, z_all)
        return rgb0, rgb1


def mse2psnr(x):
    return -10.0 * torch.log10(x)


@torch.no_grad()
def render_image(net, H, W, focal, c2w, chunk, device):
    rays_o, rays_d = get_rays(H, W, focal, c2w)
    rays_o, rays_d = rays_o.reshape(-1, 3).to(device), rays_d.reshape(-1, 3).to(device)
    out = [net(rays_o[i:i + chunk], rays_d[i:i + chunk], perturb=False)[1] for i in range(0, rays_o.shape[0], chunk)]
    return torch.cat(out).reshape(H, W, 3)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rendering the test set on rank 0 takes a few minutes, keep the others waiting at the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    # different seed per rank: each rank must draw different rays; DDP copies rank 0's weights at wrap time
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)

    assert args.N_rand % world == 0
    rays_per_rank = args.N_rand // world

    imgs, poses, H, W, focal = load_blender(args.datadir, "train", args.half_res)
    if args.white_bkgd:
        imgs = imgs[..., :3] * imgs[..., -1:] + (1.0 - imgs[..., -1:])
    else:
        imgs = imgs[..., :3]
    rays = [torch.stack(get_rays(H, W, focal, torch.from_numpy(p)), 0) for p in poses]  # [2,H,W,3]
    rays = torch.stack(rays, 0).permute(0, 2, 3, 1, 4).reshape(-1, 2, 3)                # CPU, shared by ranks
    target = torch.from_numpy(imgs).reshape(-1, 3)

    model = NeRF(args.N_samples, args.N_importance, args.white_bkgd).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lrate, betas=(0.9, 0.999))

    logdir = os.path.join(args.basedir, args.expname)
    writer = None
    if rank == 0:
        os.makedirs(logdir, exist_ok=True)
        writer = SummaryWriter(logdir)
    start = 0
    ckpts = sorted(f for f in os.listdir(logdir) if f.endswith(".tar")) if os.path.isdir(logdir) else []
    if ckpts:
        ckpt = torch.load(os.path.join(logdir, ckpts[-1]), map_location=device)
        model.module.load_state_dict(ckpt["network_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
        start = ckpt["global_step"]
        del ckpt

    t0 = time.time()
    for step in range(start + 1, args.N_iters + 1):
        sel = torch.randint(0, rays.shape[0], (rays_per_rank,))
        batch_rays = rays[sel].to(device, non_blocking=True)
        target_s = target[sel].to(device, non_blocking=True)
        rgb0, rgb1 = model(batch_rays[:, 0], batch_rays[:, 1])
        img_loss = F.mse_loss(rgb1, target_s)
        loss = img_loss + F.mse_loss(rgb0, target_s)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        new_lr = args.lrate * (0.1 ** (step / (args.lrate_decay * 1000)))
        for g in optimizer.param_groups:
            g["lr"] = new_lr

        if step % args.i_print == 0:
            stats = torch.stack([loss.detach(), img_loss.detach()])
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                psnr = mse2psnr(stats[1]).item()
                print(f"[{step}] loss {stats[0].item():.5f} psnr {psnr:.2f} {time.time() - t0:.1f}s", flush=True)
                writer.add_scalar("train/loss", stats[0].item(), step)
                writer.add_scalar("train/psnr", psnr, step)

        if step % args.i_weights == 0:
            if rank == 0:
                torch.save({"global_step": step, "network_state_dict": model.module.state_dict(),
                            "optimizer_state_dict": optimizer.state_dict()},
                           os.path.join(logdir, f"{step:06d}.tar"))
            dist.barrier()

        if step % args.i_testset == 0:
            if rank == 0:
                t_imgs, t_poses, tH, tW, tf = load_blender(args.datadir, "test", args.half_res)
                model.eval()
                psnrs = []
                for k in range(0, len(t_poses), 8):
                    rgb = render_image(model.module, tH, tW, tf, torch.from_numpy(t_poses[k]), args.chunk, device)
                    gt = torch.from_numpy(t_imgs[k][..., :3] * t_imgs[k][..., -1:] + (1 - t_imgs[k][..., -1:])).to(device)
                    psnrs.append(mse2psnr(F.mse_loss(rgb, gt)).item())
                    imageio.imwrite(os.path.join(logdir, f"test_{step:06d}_{k:03d}.png"),
                                    (rgb.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
                writer.add_scalar("test/psnr", float(np.mean(psnrs)), step)
                model.train()
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
