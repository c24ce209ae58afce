"""TensoRF (VM decomposition) on Blender scenes with DDP and resumable checkpoints.

    torchrun --nproc_per_node=4 tensorf_ddp.py --datadir data/nerf_synthetic/lego --expname lego_vm48
    # resume after preemption
    torchrun --nproc_per_node=4 tensorf_ddp.py --datadir data/nerf_synthetic/lego --expname lego_vm48 \
        --ckpt log/lego_vm48/lego_vm48.th
"""
import argparse
import json
import math
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


def config():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--expname", required=True)
    p.add_argument("--basedir", default="log")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--n_iters", type=int, default=30000)
    p.add_argument("--batch_size", type=int, default=4096, help="rays per iteration, all GPUs together")
    p.add_argument("--N_voxel_init", type=int, default=128 ** 3)
    p.add_argument("--N_voxel_final", type=int, default=300 ** 3)
    p.add_argument("--upsamp_list", type=int, nargs="+", default=[2000, 3000, 4000, 5500, 7000])
    p.add_argument("--update_AlphaMask_list", type=int, nargs="+", default=[2000, 4000])
    p.add_argument("--lr_init", type=float, default=0.02)
    p.add_argument("--lr_basis", type=float, default=1e-3)
    p.add_argument("--L1_weight", type=float, default=8e-5)
    p.add_argument("--save_every", type=int, default=5000)
    return p.parse_args()


def n_to_reso(n_voxels, aabb):
    xyz_min, xyz_max = aabb
    dim = len(xyz_min)
    voxel_size = ((xyz_max - xyz_min).prod() / n_voxels).pow(1 / dim)
    return ((xyz_max - xyz_min) / voxel_size).long().tolist()


class TensorVM(nn.Module):
    mat_mode = [[0, 1], [0, 2], [1, 2]]
    vec_mode = [2, 1, 0]

    def __init__(self, aabb, grid_size, density_comp=(16, 16, 16), app_comp=(48, 48, 48), app_dim=27):
        super().__init__()
        self.register_buffer("aabb", aabb)
        self.register_buffer("alpha_mask", torch.ones(1, 1, 1, 1, 1))
        self.density_comp, self.app_comp, self.app_dim = list(density_comp), list(app_comp), app_dim
        self.grid_size = list(grid_size)
        self.density_plane, self.density_line = self._init_vm(self.density_comp, grid_size, 0.1)
        self.app_plane, self.app_line = self._init_vm(self.app_comp, grid_size, 0.1)
        self.basis_mat = nn.Linear(sum(self.app_comp), app_dim, bias=False)
        self.render_mlp = nn.Sequential(nn.Linear(app_dim + 3 + 2 * 3 * 2 + 2 * app_dim * 2, 128), nn.ReLU(),
                                        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 3))

    def _init_vm(self, comps, res, scale):
        planes, lines = [], []
        for i, (a, b) in enumerate(self.mat_mode):
            v = self.vec_mode[i]
            planes.append(nn.Parameter(scale * torch.randn(1, comps[i], res[b], res[a])))
            lines.append(nn.Parameter(scale * torch.randn(1, comps[i], res[v], 1)))
        return nn.ParameterList(planes), nn.ParameterList(lines)

    def get_kwargs(self):
        return {"aabb": self.aabb.cpu(), "grid_size": self.grid_size, "density_comp": self.density_comp,
                "app_comp": self.app_comp, "app_dim": self.app_dim}

    def normalize(self, x):
        return (x - self.aabb[0]) / (self.aabb[1] - self.aabb[0]) * 2 - 1

    def _vm_features(self, planes, lines, xyz):
        cp = torch.stack([xyz[..., m] for m in self.mat_mode]).view(3, -1, 1, 2)
        cl = torch.stack([xyz[..., v] for v in self.vec_mode])
        cl = torch.stack([torch.zeros_like(cl), cl], -1).view(3, -1, 1, 2)
        feats = []
        for i in range(3):
            p = F.grid_sample(planes[i], cp[[i]], align_corners=True).view(-1, xyz.shape[0])
            l = F.grid_sample(lines[i], cl[[i]], align_corners=True).view(-1, xyz.shape[0])
            feats.append(p * l)
        return feats

    def density(self, xyz):
        return F.softplus(torch.stack(self._vm_features(self.density_plane, self.density_line, xyz)).sum((0, 1)) - 10)

    def appearance(self, xyz):
        return self.basis_mat(torch.cat(self._vm_features(self.app_plane, self.app_line, xyz)).T)

    def forward(self, ro, rd, n_samples, white_bg=True, perturb=True):
        near, far = 2.0, 6.0
        t = torch.linspace(near, far, n_samples, device=ro.device).expand(ro.shape[0], -1)
        if perturb:
            t = t + torch.rand_like(t[:, :1]) * (far - near) / n_samples
        pts = ro[:, None] + rd[:, None] * t[..., None]
        xyz = self.normalize(pts).view(-1, 3)
        inside = (xyz.abs() <= 1).all(-1)
        if self.alpha_mask.numel() > 1:
            m = F.grid_sample(self.alpha_mask, xyz.view(1, -1, 1, 1, 3), align_corners=True).view(-1)
            inside = inside & (m > 0.5)
        sigma = torch.zeros(xyz.shape[0], device=xyz.device)
        sigma[inside] = self.density(xyz[inside])
        sigma = sigma.view(pts.shape[:2])
        delta = torch.cat([t[:, 1:] - t[:, :-1], torch.full_like(t[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta * 25.0)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        keep = (w.view(-1) > 1e-4) & inside
        rgb = torch.zeros(xyz.shape[0], 3, device=xyz.device)
        if keep.any():
            feat = self.appearance(xyz[keep])
            vd = F.normalize(rd, dim=-1)[:, None].expand(-1, n_samples, -1).reshape(-1, 3)[keep]
            pe = lambda x, L: torch.cat([torch.sin(x[..., None] * 2 ** torch.arange(L, device=x.device)).flatten(-2),
                                         torch.cos(x[..., None] * 2 ** torch.arange(L, device=x.device)).flatten(-2)], -1)
            rgb[keep] = torch.sigmoid(self.render_mlp(torch.cat([feat, vd, pe(vd, 2), pe(feat, 2)], -1)))
        rgb = (w[..., None] * rgb.view(*pts.shape[:2], 3)).sum(1)
        if white_bg:
            rgb = rgb + (1 - w.sum(-1, keepdim=True))
        return rgb

    @torch.no_grad()
    def upsample(self, new_res):
        def up(params, is_line):
            return nn.ParameterList([nn.Parameter(F.interpolate(
                p.data, size=(new_res[self.vec_mode[i]], 1) if is_line else
                (new_res[self.mat_mode[i][1]], new_res[self.mat_mode[i][0]]),
                mode="bilinear", align_corners=True)) for i, p in enumerate(params)])
        self.density_plane, self.density_line = up(self.density_plane, False), up(self.density_line, True)
        self.app_plane, self.app_line = up(self.app_plane, False), up(self.app_line, True)
        self.grid_size = list(new_res)

    @torch.no_grad()
    def update_alpha_mask(self, res=(200, 200, 200)):
        lin = [torch.linspace(-1, 1, r, device=self.aabb.device) for r in res]
        grid = torch.stack(torch.meshgrid(*lin, indexing="ij"), -1).view(-1, 3)
        sig = torch.cat([self.density(grid[s:s + 2 ** 18]) for s in range(0, grid.shape[0], 2 ** 18)])
        alpha = 1 - torch.exp(-sig * (4.0 / res[0]) * 25.0)
        vol = alpha.view(*res).permute(2, 1, 0)[None, None]
        vol = F.max_pool3d(vol, 3, stride=1, padding=1)
        self.alpha_mask = (vol > 1e-4).float()

    def optim_groups(self, lr_grid, lr_net):
        grids = [*self.density_plane, *self.density_line, *self.app_plane, *self.app_line]
        return [{"params": grids, "lr": lr_grid}, {"params": [*self.basis_mat.parameters(), *self.render_mlp.parameters()], "lr": lr_net}]


def load_blender(root, split):
    meta = json.load(open(os.path.join(root, f"transforms_{split}.json")))
    imgs = np.stack([imageio.imread(os.path.join(root, f["file_path"] + ".png")) for f in meta["frames"]]) / 255.0
    imgs = (imgs[..., :3] * imgs[..., 3:] + 1 - imgs[..., 3:]).astype(np.float32)
    poses = np.stack([np.array(f["transform_matrix"], np.float32) for f in meta["frames"]])
    focal = 0.5 * imgs.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(imgs), torch.from_numpy(poses), focal


def rays_from(c2w, x, y, H, W, focal):
    d = torch.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -torch.ones_like(x)], -1)
    return c2w[..., :3, 3].expand(*d.shape), (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)


def main():
    args = config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(20220308)
    gen = torch.Generator(device=device).manual_seed(20220308 + rank)

    imgs, poses, focal = load_blender(args.datadir, "train")
    imgs, poses = imgs.to(device), poses.to(device)
    N, H, W = imgs.shape[:3]
    aabb = torch.tensor([[-1.5, -1.5, -1.5], [1.5, 1.5, 1.5]])
    logdir = os.path.join(args.basedir, args.expname)
    n_voxels = torch.round(torch.exp(torch.linspace(math.log(args.N_voxel_init), math.log(args.N_voxel_final),
                                                     len(args.upsamp_list) + 1))).long().tolist()[1:]

    start = 0
    if args.ckpt is not None:
        ckpt = torch.load(args.ckpt)
        tensorf = TensorVM(**ckpt["kwargs"]).to(device)
        tensorf.alpha_mask = ckpt["state_dict"]["alpha_mask"].to(device)
        tensorf.load_state_dict(ckpt["state_dict"])
        start = ckpt["step"]
    else:
        tensorf = TensorVM(aabb, n_to_reso(args.N_voxel_init, aabb)).to(device)

    def build(lr_factor):
        opt = torch.optim.Adam(tensorf.optim_groups(args.lr_init * lr_factor, args.lr_basis * lr_factor), betas=(0.9, 0.99))
        return DDP(tensorf, device_ids=[local_rank]), opt

    lr_decay = 0.1 ** (1 / args.n_iters)
    model, opt = build(lr_decay ** start)
    if args.ckpt is not None and "optimizer" in ckpt:
        opt.load_state_dict(ckpt["optimizer"])

    writer = SummaryWriter(logdir) if rank == 0 else None
    n_samples = min(1024, int(math.sqrt(sum(r * r for r in tensorf.grid_size)) / 0.5))
    rays_per_rank = args.batch_size // world
    t0 = time.time()
    for it in range(start, args.n_iters):
        i = torch.randint(0, N, (rays_per_rank,), device=device, generator=gen)
        y = torch.randint(0, H, (rays_per_rank,), device=device, generator=gen)
        x = torch.randint(0, W, (rays_per_rank,), device=device, generator=gen)
        ro, rd = rays_from(poses[i], x.float(), y.float(), H, W, focal)
        rgb = model(ro, rd, n_samples)
        mse = F.mse_loss(rgb, imgs[i, y, x])
        l1 = sum(p.abs().mean() for p in [*tensorf.density_plane, *tensorf.density_line])
        loss = mse + args.L1_weight * l1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for g in opt.param_groups:
            g["lr"] *= lr_decay

        if it % 100 == 0:
            m = mse.detach()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if writer:
                writer.add_scalar("train/psnr", -10 * torch.log10(m).item(), it)
                print(f"it {it:05d} psnr {-10 * torch.log10(m).item():.2f} res {tensorf.grid_size} "
                      f"{time.time() - t0:.0f}s", flush=True)

        # every rank applies the same deterministic grid edits, then the DDP wrapper is rebuilt
        if it + 1 in args.update_AlphaMask_list:
            tensorf.update_alpha_mask()
            model = DDP(tensorf, device_ids=[local_rank])  # new alpha_mask buffer
        if it + 1 in args.upsamp_list:
            k = args.upsamp_list.index(it + 1)
            tensorf.upsample(n_to_reso(n_voxels[k], tensorf.aabb.cpu()))
            n_samples = min(1024, int(math.sqrt(sum(r * r for r in tensorf.grid_size)) / 0.5))
            model, opt = build(lr_decay ** (it + 1))

        if (it + 1) % args.save_every == 0 and rank == 0:
            os.makedirs(logdir, exist_ok=True)
            torch.save({"kwargs": tensorf.get_kwargs(), "state_dict": tensorf.state_dict(),
                        "optimizer": opt.state_dict(), "step": it + 1},
                       os.path.join(logdir, f"{args.expname}.th"))

    if rank == 0:
        test_imgs, test_poses, _ = load_blender(args.datadir, "test")
        tensorf.eval()
        psnrs = []
        yy, xx = torch.meshgrid(torch.arange(H, device=device).float(), torch.arange(W, device=device).float(), indexing="ij")
        with torch.no_grad():
            for k in range(0, test_imgs.shape[0], 40):
                ro, rd = rays_from(test_poses[k].to(device).expand(H * W, 4, 4), xx.reshape(-1), yy.reshape(-1), H, W, focal)
                pred = torch.cat([tensorf(ro[s:s + 4096], rd[s:s + 4096], n_samples, perturb=False)
                                  for s in range(0, H * W, 4096)]).view(H, W, 3)
                psnrs.append(-10 * torch.log10(F.mse_loss(pred, test_imgs[k].to(device))).item())
        print(f"test PSNR ({len(psnrs)} views): {np.mean(psnrs):.2f}")
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
