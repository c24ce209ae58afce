"""DVGO-style direct voxel grid optimisation (coarse geometry search -> fine reconstruction), DDP.

    torchrun --nproc_per_node=4 dvgo_ddp.py --datadir data/nerf_synthetic/mic --basedir logs/dvgo --expname mic
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--datadir", required=True)
    p.add_argument("--basedir", default="logs")
    p.add_argument("--expname", required=True)
    p.add_argument("--coarse_iters", type=int, default=5000)
    p.add_argument("--fine_iters", type=int, default=20000)
    p.add_argument("--coarse_res", type=int, default=100)
    p.add_argument("--fine_res", type=int, default=160)
    p.add_argument("--N_rand", type=int, default=8192, help="rays per iteration over all GPUs")
    p.add_argument("--lr_grid", type=float, default=1e-1)
    p.add_argument("--lr_net", type=float, default=1e-3)
    p.add_argument("--stepsize", type=float, default=0.5)
    p.add_argument("--i_print", type=int, default=500)
    return p.parse_args()


class VoxelModel(nn.Module):
    def __init__(self, xyz_min, xyz_max, res, rgbnet_dim=0):
        super().__init__()
        self.register_buffer("xyz_min", xyz_min.clone())
        self.register_buffer("xyz_max", xyz_max.clone())
        self.res = res
        self.voxel_size = ((xyz_max - xyz_min).prod() / res ** 3).pow(1 / 3).item()
        size = ((xyz_max - xyz_min) / self.voxel_size).long().tolist()
        self.density = nn.Parameter(torch.zeros(1, 1, *size))
        self.rgbnet_dim = rgbnet_dim
        self.k0 = nn.Parameter(torch.zeros(1, max(rgbnet_dim, 3), *size))
        if rgbnet_dim:
            self.rgbnet = nn.Sequential(nn.Linear(rgbnet_dim + 3 + 24, 128), nn.ReLU(inplace=True),
                                        nn.Linear(128, 128), nn.ReLU(inplace=True), nn.Linear(128, 3))
        self.act_shift = math.log(1 / (1 - 1e-6) - 1)

    def grid_sample(self, grid, xyz):
        ind = ((xyz - self.xyz_min) / (self.xyz_max - self.xyz_min)).flip(-1) * 2 - 1
        return F.grid_sample(grid, ind.view(1, 1, 1, -1, 3), mode="bilinear", align_corners=True).view(grid.shape[1], -1).T

    def forward(self, ro, rd, near, far, stepsize):
        n_steps = int(((far - near) / (self.voxel_size * stepsize)))
        t = near + torch.arange(n_steps, device=ro.device) * self.voxel_size * stepsize
        pts = ro[:, None] + rd[:, None] * t[None, :, None]
        inside = ((pts >= self.xyz_min) & (pts <= self.xyz_max)).all(-1)
        flat = pts[inside]
        dens = self.grid_sample(self.density, flat)[:, 0]
        alpha_in = 1 - torch.exp(-F.softplus(dens + self.act_shift) * stepsize * self.voxel_size * 100)
        alpha = torch.zeros(inside.shape, device=ro.device, dtype=alpha_in.dtype)
        alpha[inside] = alpha_in
        k0 = self.grid_sample(self.k0, flat)
        if self.rgbnet_dim:
            vd = F.normalize(rd, dim=-1)[:, None].expand(-1, n_steps, -1)[inside]
            pe = torch.cat([vd] + [f(vd * 2 ** i) for i in range(4) for f in (torch.sin, torch.cos)], -1)
            rgb_in = torch.sigmoid(self.rgbnet(torch.cat([k0, pe], -1)))
        else:
            rgb_in = torch.sigmoid(k0)
        rgb = torch.zeros(*inside.shape, 3, device=ro.device, dtype=rgb_in.dtype)
        rgb[inside] = rgb_in
        T = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha[:, :-1] + 1e-10], -1), -1)
        w = alpha * T
        return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True)), w

    def get_kwargs(self):
        return {"xyz_min": self.xyz_min.cpu(), "xyz_max": self.xyz_max.cpu(), "res": self.res,
                "rgbnet_dim": self.rgbnet_dim}

    @torch.no_grad()
    def occupied_bbox(self, thres=1e-3):
        alpha = 1 - torch.exp(-F.softplus(self.density + self.act_shift) * self.voxel_size * 100)
        idx = (alpha[0, 0] > thres).nonzero()
        if idx.numel() == 0:
            return self.xyz_min, self.xyz_max
        lo = self.xyz_min + idx.min(0).values.float() * self.voxel_size
        hi = self.xyz_min + (idx.max(0).values.float() + 1) * self.voxel_size
        return lo, hi


def load_blender(datadir, split):
    meta = json.load(open(os.path.join(datadir, f"transforms_{split}.json")))
    ims = np.stack([imageio.imread(os.path.join(datadir, f["file_path"] + ".png")) for f in meta["frames"]]) / 255.0
    ims = (ims[..., :3] * ims[..., 3:] + (1 - ims[..., 3:])).astype(np.float32)
    poses = np.stack([np.array(f["transform_matrix"], np.float32) for f in meta["frames"]])
    focal = 0.5 * ims.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(ims), torch.from_numpy(poses), focal


def make_rays(c2w, x, y, H, W, focal):
    d = torch.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -torch.ones_like(x)], -1)
    return c2w[..., :3, 3].expand(*d.shape), (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)


def total_variation(g):
    return ((g[..., 1:, :, :] - g[..., :-1, :, :]).pow(2).mean() + (g[..., 1:, :] - g[..., :-1, :]).pow(2).mean()
            + (g[..., 1:] - g[..., :-1]).pow(2).mean())


def train_stage(stage, model, data, args, rank, world, device, gen):
    ims, poses, focal = data
    N, H, W = ims.shape[:3]
    ddp = DDP(model, device_ids=[device.index])
    groups = [{"params": [model.density, model.k0], "lr": args.lr_grid}]
    if model.rgbnet_dim:
        groups.append({"params": model.rgbnet.parameters(), "lr": args.lr_net})
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
    iters = args.coarse_iters if stage == "coarse" else args.fine_iters
    decay = 0.1 ** (1 / (iters * 1.0))
    n = args.N_rand // world
    t0 = time.time()
    for it in range(1, iters + 1):
        i = torch.randint(0, N, (n,), device=device, generator=gen)
        x = torch.randint(0, W, (n,), device=device, generator=gen)
        y = torch.randint(0, H, (n,), device=device, generator=gen)
        ro, rd = make_rays(poses[i], x.float(), y.float(), H, W, focal)
        rgb, w = ddp(ro, rd, 2.0, 6.0, args.stepsize)
        mse = F.mse_loss(rgb, ims[i, y, x])
        loss = mse + 1e-3 * (-(w.sum(-1).clamp(1e-6, 1 - 1e-6) * torch.log(w.sum(-1).clamp(1e-6, 1 - 1e-6)))).mean()
        if it < iters // 2:
            loss = loss + 1e-4 * total_variation(model.density)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for g in opt.param_groups:
            g["lr"] *= decay
        if it % args.i_print == 0:
            m = mse.detach()
            dist.all_reduce(m, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"[{stage}] it {it}/{iters} psnr {-10 * torch.log10(m).item():.2f} {time.time() - t0:.0f}s",
                      flush=True)
    return opt


def save_checkpoint(path, model, opt, global_step):
    torch.save({"global_step": global_step, "model_kwargs": model.get_kwargs(),
                "model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict()}, path)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    gen = torch.Generator(device=device).manual_seed(777 + rank)
    torch.manual_seed(777)

    ims, poses, focal = load_blender(args.datadir, "train")
    data = (ims.to(device), poses.to(device), focal)
    exp_dir = os.path.join(args.basedir, args.expname)
    os.makedirs(exp_dir, exist_ok=True)

    # ---- coarse: geometry search in the camera-bounded box
    cam_o = poses[:, :3, 3]
    xyz_min, xyz_max = cam_o.min(0).values.clamp(max=-1.5), cam_o.max(0).values.clamp(min=1.5)
    xyz_min, xyz_max = xyz_min.clamp(min=-4.0), xyz_max.clamp(max=4.0)
    coarse = VoxelModel(xyz_min, xyz_max, args.coarse_res).to(device)
    opt = train_stage("coarse", coarse, data, args, rank, world, device, gen)
    coarse_path = os.path.join(exp_dir, "coarse_last.tar")
    save_checkpoint(coarse_path, coarse, opt, args.coarse_iters)

    # ---- fine: bbox from the coarse density
    ck = torch.load(coarse_path, map_location=device)
    prev = VoxelModel(**ck["model_kwargs"]).to(device)
    prev.load_state_dict(ck["model_state_dict"])
    lo, hi = prev.occupied_bbox()
    pad = (hi - lo) * 0.05
    fine = VoxelModel(lo - pad, hi + pad, args.fine_res, rgbnet_dim=12).to(device)
    del prev, ck
    opt = train_stage("fine", fine, data, args, rank, world, device, gen)
    save_checkpoint(os.path.join(exp_dir, "fine_last.tar"), fine, opt, args.coarse_iters + args.fine_iters)

    if rank == 0:
        test_ims, test_poses, _ = load_blender(args.datadir, "test")
        H, W = test_ims.shape[1:3]
        yy, xx = torch.meshgrid(torch.arange(H, device=device).float(), torch.arange(W, device=device).float(), indexing="ij")
        psnrs = []
        with torch.no_grad():
            for k in range(0, len(test_ims), 25):
                ro, rd = make_rays(test_poses[k].to(device).expand(H * W, 4, 4), xx.reshape(-1), yy.reshape(-1), H, W, focal)
                pred = torch.cat([fine(ro[s:s + 8192], rd[s:s + 8192], 2.0, 6.0, args.stepsize)[0]
                                  for s in range(0, H * W, 8192)]).view(H, W, 3)
                psnrs.append(-10 * torch.log10(F.mse_loss(pred, test_ims[k].to(device))).item())
                imageio.imwrite(os.path.join(exp_dir, f"test_{k:03d}.png"), (pred.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
        print(f"test PSNR {np.mean(psnrs):.2f} ({len(psnrs)} views)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
