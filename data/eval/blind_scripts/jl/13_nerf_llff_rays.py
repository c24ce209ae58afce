"""nerf-pytorch style LLFF training (batched rays over all training images), multi-GPU.

Rays of all training images are built once and cached next to the data, since building
them for 4032x3024 captures takes minutes.

    torchrun --nproc_per_node=4 13_nerf_llff_rays.py --datadir data/nerf_llff_data/horns --expname horns
"""
import argparse
import glob
import os
import time

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def config_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--datadir", required=True)
    parser.add_argument("--expname", required=True)
    parser.add_argument("--basedir", default="./logs")
    parser.add_argument("--factor", type=int, default=8)
    parser.add_argument("--llffhold", type=int, default=8)
    parser.add_argument("--N_rand", type=int, default=4096, help="rays per step, summed over GPUs")
    parser.add_argument("--N_samples", type=int, default=64)
    parser.add_argument("--N_importance", type=int, default=64)
    parser.add_argument("--lrate", type=float, default=5e-4)
    parser.add_argument("--lrate_decay", type=int, default=250)
    parser.add_argument("--N_iters", type=int, default=200_000)
    parser.add_argument("--i_print", type=int, default=100)
    parser.add_argument("--i_weights", type=int, default=10_000)
    parser.add_argument("--i_testset", type=int, default=50_000)
    parser.add_argument("--raw_noise_std", type=float, default=1.0)
    return parser


def load_llff(basedir, factor):
    poses_arr = np.load(os.path.join(basedir, "poses_bounds.npy"))
    poses = poses_arr[:, :-2].reshape([-1, 3, 5]).transpose([1, 2, 0])
    bds = poses_arr[:, -2:].transpose([1, 0])
    imgfiles = sorted(glob.glob(os.path.join(basedir, f"images_{factor}", "*")))
    imgs = np.stack([imageio.imread(f)[..., :3] / 255.0 for f in imgfiles], 0).astype(np.float32)
    poses[:2, 4, :] = np.array(imgs.shape[1:3]).reshape([2, 1])
    poses[2, 4, :] = poses[2, 4, :] / factor
    poses = np.concatenate([poses[:, 1:2, :], -poses[:, 0:1, :], poses[:, 2:, :]], 1)
    poses = np.moveaxis(poses, -1, 0).astype(np.float32)
    bds = np.moveaxis(bds, -1, 0).astype(np.float32)
    sc = 1.0 / (bds.min() * 0.75)
    poses[:, :3, 3] *= sc
    bds *= sc
    hwf = poses[0, :3, -1]
    return imgs, poses[:, :3, :4], hwf


def get_rays_np(H, W, focal, c2w):
    i, j = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing="xy")
    dirs = np.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -np.ones_like(i)], -1)
    rays_d = np.sum(dirs[..., np.newaxis, :] * c2w[:3, :3], -1)
    rays_o = np.broadcast_to(c2w[:3, -1], np.shape(rays_d))
    return rays_o, rays_d


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


def build_ray_batch(imgs, poses, hwf, i_train):
    H, W, focal = int(hwf[0]), int(hwf[1]), float(hwf[2])
    rays = np.stack([np.stack(get_rays_np(H, W, focal, p), 0) for p in poses[i_train]], 0)  # [N, 2, H, W, 3]
    rays_rgb = np.concatenate([rays, imgs[i_train][:, None]], 1)  # [N, 3, H, W, 3]
    rays_rgb = np.transpose(rays_rgb, [0, 2, 3, 1, 4]).reshape([-1, 3, 3])
    return torch.from_numpy(rays_rgb.astype(np.float32))


class NeRF(nn.Module):
    def __init__(self, D=8, W=256, input_ch=63, input_ch_views=27, skips=(4,)):
        super().__init__()
        self.skips = skips
        self.pts_linears = nn.ModuleList([nn.Linear(input_ch, W)] +
                                         [nn.Linear(W, W) if i not in skips else nn.Linear(W + input_ch, W) for i in range(D - 1)])
        self.views_linears = nn.ModuleList([nn.Linear(input_ch_views + W, W // 2)])
        self.feature_linear = nn.Linear(W, W)
        self.alpha_linear = nn.Linear(W, 1)
        self.rgb_linear = nn.Linear(W // 2, 3)

    def forward(self, x, views):
        h = x
        for i, l in enumerate(self.pts_linears):
            h = F.relu(l(h))
            if i in self.skips:
                h = torch.cat([x, h], -1)
        alpha = self.alpha_linear(h)
        h = torch.cat([self.feature_linear(h), views], -1)
        for l in self.views_linears:
            h = F.relu(l(h))
        return torch.cat([self.rgb_linear(h), alpha], -1)


def embed(x, L):
    return torch.cat([x] + [fn(2.0 ** k * x) for k in range(L) for fn in (torch.sin, torch.cos)], -1)


class Pipeline(nn.Module):
    """Coarse + fine NeRF evaluated in one forward so DDP sees a single graph per step."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.coarse, self.fine = NeRF(), NeRF()

    def raw2outputs(self, raw, z, rays_d, noise_std):
        dists = torch.cat([z[..., 1:] - z[..., :-1], torch.full_like(z[..., :1], 1e10)], -1) * rays_d.norm(dim=-1, keepdim=True)
        noise = torch.randn_like(raw[..., 3]) * noise_std if noise_std > 0 else 0.0
        alpha = 1.0 - torch.exp(-F.relu(raw[..., 3] + noise) * dists)
        weights = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1.0 - alpha + 1e-10], -1), -1)[..., :-1]
        return (weights[..., None] * torch.sigmoid(raw[..., :3])).sum(-2), weights

    def run(self, net, o, d, z):
        pts = o[..., None, :] + d[..., None, :] * z[..., :, None]
        vd = F.normalize(d, dim=-1)[..., None, :].expand(pts.shape)
        return net(embed(pts, 10), embed(vd, 4))

    def forward(self, rays_o, rays_d, train=True):
        a = self.args
        rays_o, rays_d = ndc_rays(self.H, self.W, self.focal, 1.0, rays_o, rays_d)
        t = torch.linspace(0.0, 1.0, a.N_samples, device=rays_o.device)
        z = t.expand(rays_o.shape[0], a.N_samples)
        if train:
            mids = 0.5 * (z[..., 1:] + z[..., :-1])
            lower, upper = torch.cat([z[..., :1], mids], -1), torch.cat([mids, z[..., -1:]], -1)
            z = lower + (upper - lower) * torch.rand_like(z)
        noise = a.raw_noise_std if train else 0.0
        rgb0, w = self.raw2outputs(self.run(self.coarse, rays_o, rays_d, z), z, rays_d, noise)
        with torch.no_grad():
            mids = 0.5 * (z[..., 1:] + z[..., :-1])
            pdf = (w[..., 1:-1] + 1e-5) / (w[..., 1:-1] + 1e-5).sum(-1, keepdim=True)
            cdf = F.pad(torch.cumsum(pdf, -1), (1, 0))
            u = torch.rand(*cdf.shape[:-1], a.N_importance, device=cdf.device) if train else \
                torch.linspace(0, 1, a.N_importance, device=cdf.device).expand(*cdf.shape[:-1], a.N_importance).contiguous()
            idx = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[-1] - 1)
            c0, c1, b0, b1 = cdf.gather(-1, idx - 1), cdf.gather(-1, idx), mids.gather(-1, idx - 1), mids.gather(-1, idx)
            z_s = b0 + (u - c0) / (c1 - c0).clamp_min(1e-5) * (b1 - b0)
            z_all, _ = torch.sort(torch.cat([z, z_s], -1), -1)
        rgb1, _ = self.raw2outputs(self.run(self.fine, rays_o, rays_d, z_all), z_all, rays_d, noise)
        return rgb0, rgb1


def main():
    args = config_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    images, poses, hwf = load_llff(args.datadir, args.factor)
    H, W, focal = int(hwf[0]), int(hwf[1]), float(hwf[2])
    i_test = np.arange(images.shape[0])[::args.llffhold]
    i_train = np.array([i for i in range(images.shape[0]) if i not in i_test])

    cache = os.path.join(args.datadir, f"rays_rgb_f{args.factor}_hold{args.llffhold}.pt")
    if os.path.exists(cache):
        rays_rgb = torch.load(cache, map_location="cpu")
    else:
        rays_rgb = build_ray_batch(images, poses, hwf, i_train)
        torch.save(rays_rgb, cache)
    rays_rgb = rays_rgb.to(device)
    n_rays = rays_rgb.shape[0]

    pipe = Pipeline(args)
    pipe.H, pipe.W, pipe.focal = H, W, focal
    model = DDP(pipe.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lrate, betas=(0.9, 0.999))
    logdir = os.path.join(args.basedir, args.expname)
    if rank == 0:
        os.makedirs(logdir, exist_ok=True)

    n_local = args.N_rand // world
    steps_per_epoch = n_rays // (world * n_local)
    perm, epoch = None, -1
    t0 = time.time()
    for it in range(1, args.N_iters + 1):
        k = (it - 1) % steps_per_epoch
        if k == 0:
            epoch += 1
            perm = torch.randperm(n_rays, device=device, generator=torch.Generator(device=device).manual_seed(epoch))
        sl = perm[(k * world + rank) * n_local:(k * world + rank + 1) * n_local]
        batch = rays_rgb[sl]
        rgb0, rgb = model(batch[:, 0], batch[:, 1])
        target = batch[:, 2]
        loss = F.mse_loss(rgb, target) + F.mse_loss(rgb0, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        new_lrate = args.lrate * (0.1 ** (it / (args.lrate_decay * 1000)))
        for g in optimizer.param_groups:
            g["lr"] = new_lrate

        if it % args.i_print == 0:
            l = F.mse_loss(rgb.detach(), target)
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"[TRAIN] Iter {it} PSNR {-10 * torch.log10(l).item():.2f} ({(time.time() - t0) / args.i_print:.3f}s/it)",
                      flush=True)
                t0 = time.time()

        if it % args.i_weights == 0 and rank == 0:
            torch.save({"global_step": it, "network_fn_state_dict": pipe.coarse.state_dict(),
                        "network_fine_state_dict": pipe.fine.state_dict(), "optimizer_state_dict": optimizer.state_dict()},
                       os.path.join(logdir, f"{it:06d}.tar"))

        if it % args.i_testset == 0:
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for i in i_test[rank::world]:
                    ro, rd = (torch.from_numpy(np.ascontiguousarray(x)).reshape(-1, 3).to(device) for x in get_rays_np(H, W, focal, poses[i]))
                    img = torch.cat([pipe(ro[s:s + 4096], rd[s:s + 4096], train=False)[1] for s in range(0, ro.shape[0], 4096)])
                    img = img.view(H, W, 3)
                    acc[0] += -10 * torch.log10(F.mse_loss(img, torch.from_numpy(images[i]).to(device)))
                    acc[1] += 1
                    imageio.imwrite(os.path.join(logdir, f"test_{it:06d}_{i:03d}.png"), (img.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
            dist.all_reduce(acc)
            if rank == 0:
                print(f"[TEST] Iter {it} PSNR {(acc[0] / acc[1]).item():.2f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
