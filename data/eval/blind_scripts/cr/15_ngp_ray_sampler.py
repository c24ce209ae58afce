"""
Instant-NGP reimplementation (PyTorch + tiny-cuda-nn), multi-GPU.

  torchrun --nproc_per_node=4 ngp_train.py --scene data/nerf_synthetic/hotdog --workspace ws/hotdog
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
import tinycudann as tcnn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--workspace", required=True)
    p.add_argument("--iters", type=int, default=35000)
    p.add_argument("--num_rays", type=int, default=4096, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bound", type=float, default=1.0)
    p.add_argument("--grid_size", type=int, default=128)
    p.add_argument("--max_steps", type=int, default=1024)
    p.add_argument("--eval_interval", type=int, default=5000)
    return p.parse_args()


class RaySampler:
    """Keeps all training pixels + camera rays on the GPU and draws random batches."""

    def __init__(self, images, poses, focal, device="cuda:0"):
        N, H, W, _ = images.shape
        self.N, self.H, self.W = N, H, W
        self.images = images.to(device)
        self.poses = poses.to(device)
        self.focal = focal
        self.device = device

    def sample(self, n, generator=None):
        idx = torch.randint(0, self.N, (n,), device=self.device, generator=generator)
        x = torch.randint(0, self.W, (n,), device=self.device, generator=generator).float()
        y = torch.randint(0, self.H, (n,), device=self.device, generator=generator).float()
        d = torch.stack([(x + 0.5 - self.W / 2) / self.focal, -(y + 0.5 - self.H / 2) / self.focal, -torch.ones_like(x)], -1)
        c2w = self.poses[idx]
        rd = F.normalize((c2w[:, :3, :3] @ d[..., None]).squeeze(-1), dim=-1)
        ro = c2w[:, :3, 3]
        rgba = self.images[idx, y.long(), x.long()]
        return ro, rd, rgba


class NGP(nn.Module):
    def __init__(self, bound, grid_size):
        super().__init__()
        self.bound = bound
        self.grid_size = grid_size
        self.encoder = tcnn.Encoding(3, {"otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2,
                                         "log2_hashmap_size": 19, "base_resolution": 16,
                                         "per_level_scale": math.exp(math.log(2048 * bound / 16) / 15)})
        self.sigma_net = tcnn.Network(32, 16, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                               "output_activation": "None", "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.color_net = tcnn.Network(31, 3, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                              "output_activation": "None", "n_neurons": 64, "n_hidden_layers": 2})
        self.register_buffer("density_grid", torch.zeros(grid_size ** 3))
        self.register_buffer("mean_density", torch.zeros(()))

    def density(self, x):
        h = self.sigma_net(self.encoder((x + self.bound) / (2 * self.bound)))
        return torch.exp(h[:, 0].float().clamp(max=15)), h[:, 1:]

    def forward(self, x, d):
        sigma, geo = self.density(x)
        rgb = torch.sigmoid(self.color_net(torch.cat([self.dir_enc((d + 1) / 2), geo], -1)).float())
        return rgb, sigma

    def occupied(self, x):
        ijk = ((x + self.bound) / (2 * self.bound) * self.grid_size).long().clamp(0, self.grid_size - 1)
        flat = (ijk[:, 0] * self.grid_size + ijk[:, 1]) * self.grid_size + ijk[:, 2]
        return self.density_grid[flat] > torch.clamp(self.mean_density, max=0.01)

    @torch.no_grad()
    def update_density_grid(self, decay=0.95, chunk=2 ** 18):
        g = self.grid_size
        idx = torch.arange(g ** 3, device=self.density_grid.device)
        ijk = torch.stack([idx // (g * g), (idx // g) % g, idx % g], -1).float()
        new = torch.empty_like(self.density_grid)
        for s in range(0, idx.numel(), chunk):
            x = (ijk[s:s + chunk] + torch.rand_like(ijk[s:s + chunk])) / g * 2 * self.bound - self.bound
            new[s:s + chunk] = self.density(x)[0] * (2 * self.bound * math.sqrt(3) / 1024)
        return torch.maximum(self.density_grid * decay, new)


def render_rays(model, net, ro, rd, n_steps, bound, bg, perturb=True):
    """Uniform marching inside the bound; samples in empty grid cells are skipped."""
    t0 = ((-bound - ro) / rd).clamp(min=-1e9)
    t1 = ((bound - ro) / rd).clamp(min=-1e9)
    near = torch.minimum(t0, t1).max(-1).values.clamp_min(0.05)
    far = torch.maximum(t0, t1).min(-1).values.clamp_min(near + 1e-3)
    u = torch.linspace(0, 1, n_steps, device=ro.device)
    t = near[:, None] + (far - near)[:, None] * u
    if perturb:
        t = t + torch.rand_like(t) * ((far - near) / n_steps)[:, None]
    pts = (ro[:, None] + rd[:, None] * t[..., None]).reshape(-1, 3)
    dirs = rd[:, None].expand(-1, n_steps, -1).reshape(-1, 3)
    with torch.no_grad():
        keep = net.occupied(pts)
    rgb = torch.zeros(pts.shape[0], 3, device=pts.device)
    sigma = torch.zeros(pts.shape[0], device=pts.device)
    r_k, s_k = model(pts[keep], dirs[keep])
    rgb[keep], sigma[keep] = r_k, s_k
    rgb, sigma = rgb.view(-1, n_steps, 3), sigma.view(-1, n_steps)
    delta = torch.cat([t[:, 1:] - t[:, :-1], torch.full_like(t[:, :1], 1e10)], -1)
    a = 1 - torch.exp(-sigma * delta)
    w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
    return (w[..., None] * rgb).sum(1) + bg * (1 - w.sum(-1, keepdim=True))


def load(scene, split):
    meta = json.load(open(os.path.join(scene, f"transforms_{split}.json")))
    imgs = np.stack([imageio.imread(os.path.join(scene, f["file_path"] + ".png")) for f in meta["frames"]])
    poses = np.stack([np.array(f["transform_matrix"], np.float32) for f in meta["frames"]])
    poses[:, :3, 3] *= 0.33  # blender scenes into the unit bound
    focal = 0.5 * imgs.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(imgs.astype(np.float32) / 255.0), torch.from_numpy(poses), focal


def main():
    opt = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    gen = torch.Generator(device=device).manual_seed(rank)

    imgs, poses, focal = load(opt.scene, "train")
    sampler = RaySampler(imgs, poses, focal)
    net = NGP(opt.bound, opt.grid_size).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam([
        {"params": net.encoder.parameters(), "eps": 1e-15},
        {"params": list(net.sigma_net.parameters()) + list(net.color_net.parameters()), "weight_decay": 1e-6},
    ], lr=opt.lr, betas=(0.9, 0.99))
    # global batch is num_rays * world: warm up into a sqrt-scaled lr
    peak = math.sqrt(world)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: min(1.0, (it + 1) / 1000) * peak * 0.1 ** (it / opt.iters))
    scaler = torch.cuda.amp.GradScaler()
    os.makedirs(opt.workspace, exist_ok=True)

    tic = time.time()
    for it in range(1, opt.iters + 1):
        if it % 16 == 0 or it <= 256:
            grid = net.update_density_grid()
            dist.all_reduce(grid, op=dist.ReduceOp.MAX)
            net.density_grid.copy_(grid)
            net.mean_density.copy_(grid.mean())

        ro, rd, rgba = sampler.sample(opt.num_rays, generator=gen)
        bg = torch.rand(3, device=device, generator=gen)
        gt = rgba[:, :3] * rgba[:, 3:] + bg * (1 - rgba[:, 3:])
        with torch.autocast("cuda", dtype=torch.float16):
            pred = render_rays(model, net, ro, rd, opt.max_steps // 4, opt.bound, bg)
            loss = F.smooth_l1_loss(pred.float(), gt)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        sched.step()

        if it % 200 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                occ = (net.density_grid > torch.clamp(net.mean_density, max=0.01)).float().mean().item()
                print(f"it {it} loss {l.item():.5f} occ {occ:.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - tic:.0f}s", flush=True)

        if it % opt.eval_interval == 0 and rank == 0:
            test_imgs, test_poses, _ = load(opt.scene, "test")
            H, W = test_imgs.shape[1:3]
            psnrs = []
            yy, xx = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                for k in range(0, len(test_imgs), 40):
                    c2w = test_poses[k].to(device)
                    d = torch.stack([(xx.reshape(-1) + 0.5 - W / 2) / focal, -(yy.reshape(-1) + 0.5 - H / 2) / focal,
                                     -torch.ones(H * W, device=device)], -1)
                    rd = F.normalize(d @ c2w[:3, :3].T, dim=-1)
                    ro = c2w[:3, 3].expand_as(rd)
                    white = torch.ones(3, device=device)
                    pred = torch.cat([render_rays(net, net, ro[s:s + 16384], rd[s:s + 16384], opt.max_steps // 4,
                                                  opt.bound, white, perturb=False) for s in range(0, H * W, 16384)])
                    g = test_imgs[k].to(device).view(-1, 4)
                    g = g[:, :3] * g[:, 3:] + (1 - g[:, 3:])
                    psnrs.append(-10 * torch.log10(F.mse_loss(pred.float(), g)).item())
            print(f"[eval it {it}] PSNR {np.mean(psnrs):.2f} ({len(psnrs)} views)", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "it": it},
                       os.path.join(opt.workspace, f"ngp_{it:06d}.pth"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
