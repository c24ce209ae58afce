"""TensoRF (VM decomposition) with distributed ray batches and resumable training.

    torchrun --nproc_per_node=4 10_tensorf_vm.py --datadir /data/nerf_synthetic/ship --expname ship_vm
    torchrun --nproc_per_node=4 10_tensorf_vm.py --datadir /data/nerf_synthetic/ship --expname ship_vm \
        --ckpt log/ship_vm/ship_vm.th
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
from torch.utils.tensorboard import SummaryWriter


def config_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--expname", required=True)
    p.add_argument("--basedir", default="log")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--n_iters", type=int, default=30000)
    p.add_argument("--batch_size", type=int, default=4096, help="global")
    p.add_argument("--res", type=int, default=300)
    p.add_argument("--n_comp_density", type=int, default=16)
    p.add_argument("--n_comp_app", type=int, default=48)
    p.add_argument("--lr_grid", type=float, default=0.02)
    p.add_argument("--lr_net", type=float, default=1e-3)
    p.add_argument("--lr_decay_target", type=float, default=0.1)
    p.add_argument("--tv_weight_density", type=float, default=0.0)
    p.add_argument("--l1_weight", type=float, default=8e-5)
    p.add_argument("--n_samples", type=int, default=443)
    p.add_argument("--save_every", type=int, default=5000)
    return p.parse_args()


class TensorVM(nn.Module):
    def __init__(self, res, n_den, n_app, aabb=1.5, app_dim=27):
        super().__init__()
        self.aabb = aabb
        mats = [(0, 1), (0, 2), (1, 2)]
        self.vec_ids = [2, 1, 0]
        self.mat_ids = mats
        self.den_plane = nn.ParameterList([nn.Parameter(0.1 * torch.randn(1, n_den, res, res)) for _ in range(3)])
        self.den_line = nn.ParameterList([nn.Parameter(0.1 * torch.randn(1, n_den, res, 1)) for _ in range(3)])
        self.app_plane = nn.ParameterList([nn.Parameter(0.1 * torch.randn(1, n_app, res, res)) for _ in range(3)])
        self.app_line = nn.ParameterList([nn.Parameter(0.1 * torch.randn(1, n_app, res, 1)) for _ in range(3)])
        self.basis = nn.Linear(3 * n_app, app_dim, bias=False)
        self.render_mlp = nn.Sequential(nn.Linear(app_dim + 3 + 2 * 2 * (app_dim + 3), 128), nn.ReLU(True),
                                        nn.Linear(128, 128), nn.ReLU(True), nn.Linear(128, 3))

    def _vm(self, planes, lines, x):
        out = []
        for i, (a, b) in enumerate(self.mat_ids):
            pc = torch.stack([x[:, a], x[:, b]], -1).view(1, -1, 1, 2)
            lc = torch.stack([torch.zeros_like(x[:, 0]), x[:, self.vec_ids[i]]], -1).view(1, -1, 1, 2)
            p = F.grid_sample(planes[i], pc, align_corners=True).view(planes[i].shape[1], -1)
            l = F.grid_sample(lines[i], lc, align_corners=True).view(lines[i].shape[1], -1)
            out.append(p * l)
        return out

    def density(self, x):
        return F.softplus(sum(v.sum(0) for v in self._vm(self.den_plane, self.den_line, x)) - 10.0)

    def appearance(self, x):
        return self.basis(torch.cat(self._vm(self.app_plane, self.app_line, x), 0).T)

    @staticmethod
    def pe(x, n):
        f = 2.0 ** torch.arange(n, device=x.device)
        xf = (x[..., None] * f).flatten(-2)
        return torch.cat([xf.sin(), xf.cos()], -1)

    def forward(self, rays_o, rays_d, n_samples, perturb=True):
        inv = 1.0 / torch.where(rays_d.abs() < 1e-6, torch.full_like(rays_d, 1e-6), rays_d)
        ta, tb = (-self.aabb - rays_o) * inv, (self.aabb - rays_o) * inv
        near = torch.minimum(ta, tb).amax(-1).clamp(min=0.05)
        far = torch.maximum(ta, tb).amin(-1).clamp(min=0.1)
        t = torch.linspace(0, 1, n_samples, device=rays_o.device)
        z = near[:, None] + (far - near)[:, None] * t
        if perturb:
            z = z + torch.rand_like(z[:, :1]) * ((far - near) / n_samples)[:, None]
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        inside = (pts.abs() <= self.aabb).all(-1)
        xn = (pts / self.aabb).reshape(-1, 3)
        sigma = torch.zeros(z.shape, device=z.device)
        sigma[inside] = self.density(xn[inside.reshape(-1)])
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.zeros_like(z[:, :1])], -1)
        alpha = 1 - torch.exp(-sigma * delta * 25.0)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        rgb = torch.zeros(*z.shape, 3, device=z.device)
        feat = self.appearance(xn[inside.reshape(-1)])
        dirs = rays_d[:, None].expand_as(pts)[inside]
        rgb[inside] = torch.sigmoid(self.render_mlp(torch.cat([feat, dirs, self.pe(feat, 2), self.pe(dirs, 2)], -1)))
        acc = w.sum(-1, keepdim=True)
        return (w[..., None] * rgb).sum(1) + (1 - acc), acc

    def l1_density(self):
        return sum(p.abs().mean() for p in self.den_plane) + sum(l.abs().mean() for l in self.den_line)


def load_blender(root, split):
    with open(os.path.join(root, f"transforms_{split}.json")) as f:
        meta = json.load(f)
    imgs = np.stack([imageio.imread(os.path.join(root, fr["file_path"] + ".png")) for fr in meta["frames"]]) / 255.0
    imgs = imgs[..., :3] * imgs[..., 3:] + (1 - imgs[..., 3:])
    poses = np.stack([fr["transform_matrix"] for fr in meta["frames"]]).astype(np.float32)
    focal = 0.5 * imgs.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return torch.tensor(imgs, dtype=torch.float32), torch.from_numpy(poses), focal


def all_rays(poses, H, W, focal):
    j, i = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    d = torch.stack([(i - W / 2) / focal, -(j - H / 2) / focal, -torch.ones_like(i)], -1)
    d = torch.einsum("nij,hwj->nhwi", poses[:, :3, :3], d)
    d = d / d.norm(dim=-1, keepdim=True)
    o = poses[:, None, None, :3, 3].expand_as(d)
    return o.reshape(-1, 3), d.reshape(-1, 3)


def main():
    args = config_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logdir = os.path.join(args.basedir, args.expname)

    imgs, poses, focal = load_blender(args.datadir, "train")
    H, W = imgs.shape[1:3]
    rays_o, rays_d = all_rays(poses, H, W, focal)
    rgbs = imgs.reshape(-1, 3)
    g = torch.Generator().manual_seed(20211202 + rank)

    model = TensorVM(args.res, args.n_comp_density, args.n_comp_app).to(device)
    grid_params = [p for n, p in model.named_parameters() if "plane" in n or "line" in n]
    net_params = [p for n, p in model.named_parameters() if not ("plane" in n or "line" in n)]
    optim = torch.optim.Adam([{"params": grid_params, "lr": args.lr_grid},
                              {"params": net_params, "lr": args.lr_net}], betas=(0.9, 0.99))
    start = 0
    if args.ckpt is not None and os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt)
        model.load_state_dict(ckpt["state_dict"])
        optim.load_state_dict(ckpt["optim"])
        start = ckpt["iter"]
        if rank == 0:
            print(f"resumed from {args.ckpt} at iteration {start}")
    model = DDP(model, device_ids=[local_rank])
    # on resume the already-decayed learning rates come back with the optimizer state
    decay = args.lr_decay_target ** (1 / args.n_iters)

    writer = SummaryWriter(logdir) if rank == 0 else None
    per_rank = args.batch_size // world
    for it in range(start, args.n_iters):
        sel = torch.randint(0, rays_o.shape[0], (per_rank,), generator=g)
        ro, rd, gt = rays_o[sel].to(device), rays_d[sel].to(device), rgbs[sel].to(device)
        rgb, _ = model(ro, rd, args.n_samples)
        mse = F.mse_loss(rgb, gt)
        loss = mse + args.l1_weight * model.module.l1_density()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        for grp in optim.param_groups:
            grp["lr"] *= decay

        if (it + 1) % 100 == 0:
            m = mse.detach().clone()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/PSNR", -10 * math.log10(m.item()), it + 1)
                writer.add_scalar("train/mse", m.item(), it + 1)

        if (it + 1) % args.save_every == 0 or it + 1 == args.n_iters:
            if rank == 0:
                torch.save({"iter": it + 1, "state_dict": model.module.state_dict(), "optim": optim.state_dict()},
                           os.path.join(logdir, f"{args.expname}.th"))
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
