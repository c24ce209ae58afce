"""TensoRF (VM decomposition) on NeRF-synthetic, trained with DDP.

Rays are sampled per image batch on every GPU; the grid is upsampled at fixed steps,
after which the optimizer and the DDP wrapper are rebuilt on every rank.

    torchrun --nproc_per_node=4 05_tensorf_ddp.py --datadir data/nerf_synthetic/chair --expname chair_vm
"""
import argparse
import datetime
import json
import math
import os

import imageio.v2 as imageio
import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MAT, VEC = [(0, 1), (0, 2), (1, 2)], [2, 1, 0]


def get_opts():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--expname", required=True)
    p.add_argument("--basedir", default="./log")
    p.add_argument("--n_iters", type=int, default=30000)
    p.add_argument("--batch_size", type=int, default=4096, help="global ray batch")
    p.add_argument("--N_voxel_init", type=int, default=128 ** 3)
    p.add_argument("--N_voxel_final", type=int, default=300 ** 3)
    p.add_argument("--upsamp_list", type=int, nargs="+", default=[2000, 3000, 4000, 5500, 7000])
    p.add_argument("--n_lamb_sigma", type=int, default=16)
    p.add_argument("--n_lamb_sh", type=int, default=48)
    p.add_argument("--lr_init", type=float, default=0.02)
    p.add_argument("--lr_basis", type=float, default=1e-3)
    p.add_argument("--L1_weight", type=float, default=8e-5)
    p.add_argument("--n_samples", type=int, default=512)
    p.add_argument("--save_every", type=int, default=5000)
    p.add_argument("--vis_every", type=int, default=10000)
    p.add_argument("--downsample", type=float, default=1.0)
    return p.parse_args()


def load_split(root, split, downsample):
    meta = json.load(open(os.path.join(root, f"transforms_{split}.json")))
    imgs, c2ws = [], []
    for fr in meta["frames"]:
        im = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        if downsample != 1.0:
            im = F.interpolate(torch.from_numpy(im).permute(2, 0, 1)[None], scale_factor=1 / downsample,
                               mode="bilinear", align_corners=False)[0].permute(1, 2, 0).numpy()
        im = im[..., :3] * im[..., 3:] + (1 - im[..., 3:])
        imgs.append(im)
        c2ws.append(np.array(fr["transform_matrix"], dtype=np.float32))
    H, W = imgs[0].shape[:2]
    focal = 0.5 * W / np.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(np.stack(imgs)), torch.from_numpy(np.stack(c2ws)), H, W, focal


def rays_for(H, W, focal, c2w):
    i, j = torch.meshgrid(torch.arange(W) + 0.5, torch.arange(H) + 0.5, indexing="xy")
    d = torch.stack([(i - W / 2) / focal, -(j - H / 2) / focal, -torch.ones_like(i)], -1) @ c2w[:3, :3].T
    d = d / d.norm(dim=-1, keepdim=True)
    return torch.cat([c2w[:3, 3].expand_as(d), d], -1).view(-1, 6)


def n_to_reso(n_voxels, aabb):
    size = aabb[1] - aabb[0]
    vox = ((size.prod() / n_voxels) ** (1 / 3)).item()
    return (size / vox).long().tolist()


class TensorVM(nn.Module):
    def __init__(self, aabb, reso, n_sigma, n_app, app_dim=27):
        super().__init__()
        self.register_buffer("aabb", aabb)
        self.reso = reso
        self.density_plane, self.density_line = self._init(n_sigma, reso, 0.1)
        self.app_plane, self.app_line = self._init(n_app, reso, 0.1)
        self.basis_mat = nn.Linear(3 * n_app, app_dim, bias=False)
        in_dim = app_dim + 3 + 2 * 2 * app_dim + 2 * 2 * 3
        self.render_mlp = nn.Sequential(nn.Linear(in_dim, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 3))
        nn.init.constant_(self.render_mlp[-1].bias, 0)

    @staticmethod
    def _init(n, reso, scale):
        planes = [nn.Parameter(scale * torch.randn(1, n, reso[MAT[i][1]], reso[MAT[i][0]])) for i in range(3)]
        lines = [nn.Parameter(scale * torch.randn(1, n, reso[VEC[i]], 1)) for i in range(3)]
        return nn.ParameterList(planes), nn.ParameterList(lines)

    def grad_groups(self, lr_grid, lr_net):
        return [{"params": list(self.density_plane) + list(self.density_line) + list(self.app_plane) + list(self.app_line),
                 "lr": lr_grid},
                {"params": list(self.basis_mat.parameters()) + list(self.render_mlp.parameters()), "lr": lr_net}]

    def _feat(self, planes, lines, x):
        out = []
        for i in range(3):
            cp = x[:, list(MAT[i])].view(1, -1, 1, 2)
            cl = torch.stack([torch.zeros_like(x[:, VEC[i]]), x[:, VEC[i]]], -1).view(1, -1, 1, 2)
            pf = F.grid_sample(planes[i], cp, align_corners=True).view(planes[i].shape[1], -1)
            lf = F.grid_sample(lines[i], cl, align_corners=True).view(lines[i].shape[1], -1)
            out.append(pf * lf)
        return out

    @torch.no_grad()
    def upsample(self, reso):
        for planes, lines in ((self.density_plane, self.density_line), (self.app_plane, self.app_line)):
            for i in range(3):
                planes[i] = nn.Parameter(F.interpolate(planes[i].data, size=(reso[MAT[i][1]], reso[MAT[i][0]]),
                                                       mode="bilinear", align_corners=True))
                lines[i] = nn.Parameter(F.interpolate(lines[i].data, size=(reso[VEC[i]], 1),
                                                      mode="bilinear", align_corners=True))
        self.reso = reso

    def l1_density(self):
        return sum(p.abs().mean() + l.abs().mean() for p, l in zip(self.density_plane, self.density_line))

    def forward(self, rays, n_samples, perturb=True):
        o, d = rays[:, :3], rays[:, 3:]
        t = torch.linspace(2.0, 6.0, n_samples, device=rays.device).expand(rays.shape[0], -1)
        if perturb:
            t = t + torch.rand_like(t[:, :1]) * (4.0 / n_samples)
        pts = o[:, None] + d[:, None] * t[..., None]
        xn = (pts - self.aabb[0]) / (self.aabb[1] - self.aabb[0]) * 2 - 1
        inside = (xn.abs() <= 1).all(-1)
        sigma = torch.zeros(t.shape, device=rays.device)
        rgb = torch.zeros(*t.shape, 3, device=rays.device)
        xv = xn[inside]
        if xv.shape[0] > 0:
            sigma[inside] = F.softplus(sum(f.sum(0) for f in self._feat(self.density_plane, self.density_line, xv)) - 10.0)
            app = self.basis_mat(torch.cat(self._feat(self.app_plane, self.app_line, xv), 0).T)
            vd = d[:, None].expand_as(pts)[inside]
            enc = [app, vd] + [f(2.0 ** k * x) for x in (app, vd) for k in range(2) for f in (torch.sin, torch.cos)]
            rgb[inside] = torch.sigmoid(self.render_mlp(torch.cat(enc, -1)))
        dist_ = torch.cat([t[:, 1:] - t[:, :-1], torch.zeros_like(t[:, :1])], -1)
        alpha = 1 - torch.exp(-sigma * dist_ * 25.0)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        acc = w.sum(-1, keepdim=True)
        return (w[..., None] * rgb).sum(1) + (1 - acc)


def save_checkpoint(tensorf, optimizer, it, path):
    torch.save({"reso": tensorf.reso, "state_dict": tensorf.state_dict(), "optimizer": optimizer.state_dict(),
                "iteration": it}, path)


def main():
    args = get_opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logdir = os.path.join(args.basedir, args.expname)
    os.makedirs(logdir, exist_ok=True)

    imgs, c2ws, H, W, focal = load_split(args.datadir, "train", args.downsample)
    all_rays = torch.cat([rays_for(H, W, focal, c) for c in c2ws]).to(device)
    all_rgbs = imgs.reshape(-1, 3).to(device)
    test_imgs, test_c2ws, _, _, _ = load_split(args.datadir, "test", args.downsample)

    aabb = torch.tensor([[-1.5, -1.5, -1.5], [1.5, 1.5, 1.5]], device=device)
    reso = n_to_reso(args.N_voxel_init, aabb)
    upsamp_resos = [n_to_reso(int(round(math.exp(x))), aabb) for x in
                    torch.linspace(math.log(args.N_voxel_init), math.log(args.N_voxel_final),
                                   len(args.upsamp_list) + 1)[1:].tolist()]
    tensorf = TensorVM(aabb, reso, args.n_lamb_sigma, args.n_lamb_sh).to(device)
    ckpt_path = os.path.join(logdir, f"{args.expname}.th")
    start, ck = 0, None
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        tensorf.upsample(ck["reso"])
        tensorf.load_state_dict(ck["state_dict"])
        start = ck["iteration"]

    model = DDP(tensorf, device_ids=[local_rank])
    optimizer = torch.optim.Adam(tensorf.grad_groups(args.lr_init, args.lr_basis), betas=(0.9, 0.99))
    if ck is not None:
        optimizer.load_state_dict(ck["optimizer"])
        del ck
    lr_factor = 0.1 ** (1 / args.n_iters)
    per_gpu = args.batch_size // world
    g = torch.Generator(device=device).manual_seed(20211202 + rank)
    lpips_vgg = lpips.LPIPS(net="vgg").to(device)

    for it in range(start, args.n_iters):
        idx = torch.randint(all_rays.shape[0], (per_gpu,), device=device, generator=g)
        rgb = model(all_rays[idx], args.n_samples)
        mse = F.mse_loss(rgb, all_rgbs[idx])
        loss = mse + args.L1_weight * tensorf.l1_density()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for pg in optimizer.param_groups:
            pg["lr"] *= lr_factor

        if (it + 1) % 100 == 0:
            m = mse.detach().clone()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"it {it + 1:05d} train_psnr {-10 * math.log10(m.item()):.2f} mse {m.item():.6f}", flush=True)

        if it + 1 in args.upsamp_list:
            reso = upsamp_resos[args.upsamp_list.index(it + 1)]
            tensorf.upsample(reso)
            scale = lr_factor ** (it + 1)
            model = DDP(tensorf, device_ids=[local_rank])
            optimizer = torch.optim.Adam(tensorf.grad_groups(args.lr_init * scale, args.lr_basis * scale), betas=(0.9, 0.99))
            if rank == 0:
                print(f"upsampled grid to {reso}", flush=True)

        if (it + 1) % args.save_every == 0:
            save_checkpoint(tensorf, optimizer, it + 1, ckpt_path)

        if (it + 1) % args.vis_every == 0 or it + 1 == args.n_iters:
            res = torch.zeros(3, device=device)
            with torch.no_grad():
                for k in range(rank, len(test_imgs), world):
                    rays = rays_for(H, W, focal, test_c2ws[k]).to(device)
                    pred = torch.cat([tensorf(rays[s:s + 4096], args.n_samples, perturb=False)
                                      for s in range(0, rays.shape[0], 4096)]).view(H, W, 3).clamp(0, 1)
                    gt = test_imgs[k].to(device)
                    res[0] += -10 * torch.log10(F.mse_loss(pred, gt))
                    res[1] += lpips_vgg(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], normalize=True).squeeze()
                    res[2] += 1
                    imageio.imwrite(os.path.join(logdir, f"{it + 1:06d}_{k:03d}.png"), (pred.cpu().numpy() * 255).astype(np.uint8))
            dist.all_reduce(res)
            if rank == 0:
                print(f"[test @ {it + 1}] PSNR {res[0] / res[2]:.3f} LPIPS {res[1] / res[2]:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
