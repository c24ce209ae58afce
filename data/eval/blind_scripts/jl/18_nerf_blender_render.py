"""NeRF training on Blender scenes with a final spiral-video render, multi-GPU.

    # train (4 GPUs) and render the 360 video at the end
    torchrun --nproc_per_node=4 18_nerf_blender_render.py --datadir data/nerf_synthetic/materials --expdir exp/materials
    # re-render an existing run on one GPU
    python 18_nerf_blender_render.py --datadir data/nerf_synthetic/materials --expdir exp/materials --render_only
"""
import argparse
import json
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--expdir", required=True)
    p.add_argument("--render_only", action="store_true")
    p.add_argument("--n_iters", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=4096, help="rays per step, all GPUs")
    p.add_argument("--n_samples", type=int, default=64)
    p.add_argument("--n_importance", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--half_res", action="store_true")
    p.add_argument("--save_every", type=int, default=10_000)
    p.add_argument("--video_frames", type=int, default=120)
    return p.parse_args()


def load_blender(root, split, half_res):
    meta = json.load(open(os.path.join(root, f"transforms_{split}.json")))
    imgs = []
    for fr in meta["frames"]:
        im = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        if half_res:
            im = im.reshape(im.shape[0] // 2, 2, im.shape[1] // 2, 2, 4).mean((1, 3))
        imgs.append(im[..., :3] * im[..., 3:] + 1 - im[..., 3:])
    poses = np.stack([np.array(fr["transform_matrix"], np.float32) for fr in meta["frames"]])
    H, W = imgs[0].shape[:2]
    return np.stack(imgs), poses, H, W, 0.5 * W / math.tan(0.5 * meta["camera_angle_x"])


def spherical_pose(theta, phi, radius):
    trans_t = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, radius], [0, 0, 0, 1]], np.float32)
    rot_phi = np.array([[1, 0, 0, 0], [0, math.cos(phi), -math.sin(phi), 0], [0, math.sin(phi), math.cos(phi), 0], [0, 0, 0, 1]], np.float32)
    rot_theta = np.array([[math.cos(theta), 0, -math.sin(theta), 0], [0, 1, 0, 0], [math.sin(theta), 0, math.cos(theta), 0], [0, 0, 0, 1]], np.float32)
    c2w = rot_theta @ rot_phi @ trans_t
    return np.array([[-1, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]], np.float32) @ c2w


def get_rays(H, W, focal, c2w):
    c2w = torch.as_tensor(c2w)
    i, j = torch.meshgrid(torch.arange(W, dtype=torch.float32), torch.arange(H, dtype=torch.float32), indexing="xy")
    d = torch.stack([(i - W * 0.5) / focal, -(j - H * 0.5) / focal, -torch.ones_like(i)], -1) @ c2w[:3, :3].T
    return c2w[:3, 3].expand_as(d).reshape(-1, 3), d.reshape(-1, 3)


def enc(x, n):
    return torch.cat([x] + [f(x * 2.0 ** k) for k in range(n) for f in (torch.sin, torch.cos)], -1)


class MLP(nn.Module):
    def __init__(self, W=256):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(63, W)] + [nn.Linear(W + (63 if i == 4 else 0), W) for i in range(1, 8)])
        self.sigma = nn.Linear(W, 1)
        self.feat = nn.Linear(W, W)
        self.dir = nn.Linear(W + 27, W // 2)
        self.rgb = nn.Linear(W // 2, 3)

    def forward(self, x, d):
        ex = enc(x, 10)
        h = ex
        for i, l in enumerate(self.layers):
            h = F.relu(l(torch.cat([h, ex], -1) if i == 4 else h))
        s = self.sigma(h)[..., 0]
        h = F.relu(self.dir(torch.cat([self.feat(h), enc(d, 4)], -1)))
        return torch.sigmoid(self.rgb(h)), s


class NeRF(nn.Module):
    def __init__(self, n_samples, n_importance, near=2.0, far=6.0):
        super().__init__()
        self.coarse, self.fine = MLP(), MLP()
        self.ns, self.ni, self.near, self.far = n_samples, n_importance, near, far

    @staticmethod
    def composite(rgb, sigma, z, d):
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * d.norm(dim=-1, keepdim=True)
        a = 1 - torch.exp(-F.relu(sigma) * delta)
        w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1) + 1 - w.sum(-1, keepdim=True), w

    def forward(self, o, d, perturb=True):
        vd = F.normalize(d, dim=-1)
        z = torch.linspace(self.near, self.far, self.ns, device=o.device).expand(o.shape[0], -1)
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (self.far - self.near) / self.ns
        rgb, s = self.coarse(o[:, None] + d[:, None] * z[..., None], vd[:, None].expand(-1, self.ns, -1))
        c0, w = self.composite(rgb, s, z, d)
        with torch.no_grad():
            cdf = F.pad(torch.cumsum((w[:, :-1] + 1e-5) / (w[:, :-1] + 1e-5).sum(-1, keepdim=True), -1), (1, 0))
            u = torch.rand(o.shape[0], self.ni, device=o.device) if perturb else torch.linspace(0, 1, self.ni, device=o.device).repeat(o.shape[0], 1)
            k = torch.searchsorted(cdf, u.contiguous(), right=True).clamp(1, self.ns - 1)
            z_i = z.gather(1, k - 1) + (u - cdf.gather(1, k - 1)) / (cdf.gather(1, k) - cdf.gather(1, k - 1)).clamp_min(1e-5) \
                * (z.gather(1, k) - z.gather(1, k - 1))
            zz, _ = torch.sort(torch.cat([z, z_i], -1), -1)
        n = zz.shape[1]
        rgb, s = self.fine(o[:, None] + d[:, None] * zz[..., None], vd[:, None].expand(-1, n, -1))
        c1, _ = self.composite(rgb, s, zz, d)
        return c0, c1


@torch.no_grad()
def render_video(args, ckpt_path, device):
    _, _, H, W, focal = load_blender(args.datadir, "test", args.half_res)
    net = NeRF(args.n_samples, args.n_importance).to(device).eval()
    ckpt = torch.load(ckpt_path, map_location=device)
    net.load_state_dict(ckpt["model"])
    frames = []
    for th in tqdm(np.linspace(-math.pi, math.pi, args.video_frames, endpoint=False), desc="video"):
        o, d = get_rays(H, W, focal, spherical_pose(th, -math.pi / 6, 4.0))
        o, d = o.to(device), d.to(device)
        img = torch.cat([net(o[s:s + 8192], d[s:s + 8192], perturb=False)[1] for s in range(0, o.shape[0], 8192)])
        frames.append((img.view(H, W, 3).clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
    imageio.mimwrite(os.path.join(args.expdir, "spiral.mp4"), frames, fps=30, quality=8)


def main():
    args = args_parser()
    ckpt_path = os.path.join(args.expdir, "model.ckpt")
    if args.render_only:
        render_video(args, ckpt_path, torch.device("cuda"))
        return

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    imgs, poses, H, W, focal = load_blender(args.datadir, "train", args.half_res)
    rays = [get_rays(H, W, focal, p) for p in poses]
    all_o = torch.cat([r[0] for r in rays]).to(device)
    all_d = torch.cat([r[1] for r in rays]).to(device)
    all_c = torch.from_numpy(imgs).reshape(-1, 3).to(device)
    test_imgs, test_poses, _, _, _ = load_blender(args.datadir, "test", args.half_res)

    model = DDP(NeRF(args.n_samples, args.n_importance).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.1 ** (1 / args.n_iters))
    it0 = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        it0 = ckpt["it"]
    g = torch.Generator(device=device)
    g.manual_seed(12345 + rank)

    for it in range(it0 + 1, args.n_iters + 1):
        sel = torch.randint(0, all_o.shape[0], (args.batch // world,), device=device, generator=g)
        c0, c1 = model(all_o[sel], all_d[sel])
        loss = F.mse_loss(c0, all_c[sel]) + F.mse_loss(c1, all_c[sel])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

        if it % 500 == 0:
            m = F.mse_loss(c1.detach(), all_c[sel])
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"iter {it}: psnr {-10 * math.log10(m.item()):.2f}", flush=True)

        if it % args.save_every == 0 or it == args.n_iters:
            s = torch.zeros(2, device=device)
            with torch.no_grad():
                for i in range(rank, len(test_imgs), world * 4):
                    o, d = get_rays(H, W, focal, test_poses[i])
                    o, d = o.to(device), d.to(device)
                    img = torch.cat([model.module(o[k:k + 8192], d[k:k + 8192], perturb=False)[1] for k in range(0, o.shape[0], 8192)])
                    s += torch.stack([-10 * torch.log10(F.mse_loss(img, torch.from_numpy(test_imgs[i]).reshape(-1, 3).to(device))),
                                      torch.ones((), device=device)])
            dist.all_reduce(s)
            if rank == 0:
                print(f"iter {it}: test psnr {(s[0] / s[1]).item():.2f} on {int(s[1])} views", flush=True)
                os.makedirs(args.expdir, exist_ok=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "it": it},
                           ckpt_path)
            dist.barrier()

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        render_video(args, ckpt_path, device)


if __name__ == "__main__":
    main()
