"""Instant-NGP with nerfacc's occupancy grid, multi-GPU (DDP) training on NeRF-synthetic.

    torchrun --nproc_per_node=4 11_ngp_occupancy.py --data_root data/nerf_synthetic --scene hotdog
"""
import argparse
import json
import math
import os
import time

import imageio.v2 as imageio
import numpy as np
import tinycudann as tcnn
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lpips import LPIPS
from nerfacc import OccGridEstimator, rendering
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--scene", default="lego")
    p.add_argument("--out", default="outputs/ngp")
    p.add_argument("--max_steps", type=int, default=20_000)
    p.add_argument("--init_batch_size", type=int, default=1024)
    p.add_argument("--target_sample_batch_size", type=int, default=1 << 18, help="samples per step, all GPUs")
    p.add_argument("--grid_resolution", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def load(root, scene, split):
    meta = json.load(open(os.path.join(root, scene, f"transforms_{split}.json")))
    imgs = np.stack([imageio.imread(os.path.join(root, scene, f["file_path"] + ".png")) for f in meta["frames"]])
    poses = np.stack([np.array(f["transform_matrix"], np.float32) for f in meta["frames"]])
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(imgs).float() / 255.0, torch.from_numpy(poses), H, W, focal


class NGPRadianceField(torch.nn.Module):
    def __init__(self, aabb, n_levels=16, log2_hashmap_size=19, max_res=4096):
        super().__init__()
        self.register_buffer("aabb", aabb)
        per_level_scale = math.exp((math.log(max_res) - math.log(16)) / (n_levels - 1))
        self.direction_encoding = tcnn.Encoding(3, {"otype": "Composite", "nested": [
            {"n_dims_to_encode": 3, "otype": "SphericalHarmonics", "degree": 4}]})
        self.mlp_base = tcnn.NetworkWithInputEncoding(
            n_input_dims=3, n_output_dims=16,
            encoding_config={"otype": "HashGrid", "n_levels": n_levels, "n_features_per_level": 2,
                             "log2_hashmap_size": log2_hashmap_size, "base_resolution": 16, "per_level_scale": per_level_scale},
            network_config={"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                            "n_neurons": 64, "n_hidden_layers": 1})
        self.mlp_head = tcnn.Network(
            n_input_dims=self.direction_encoding.n_output_dims + 15, n_output_dims=3,
            network_config={"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "Sigmoid",
                            "n_neurons": 64, "n_hidden_layers": 2})

    def _base(self, x):
        lo, hi = self.aabb[:3], self.aabb[3:]
        x = (x - lo) / (hi - lo)
        selector = ((x > 0.0) & (x < 1.0)).all(dim=-1)
        h = self.mlp_base(x.view(-1, 3)).float()
        density = torch.exp(h[:, :1] - 1.0) * selector[..., None]
        return density, h[:, 1:]

    def query_density(self, x):
        return self._base(x)[0]

    def forward(self, x, d):
        density, feat = self._base(x)
        dir_enc = self.direction_encoding((d + 1.0) / 2.0)
        rgb = self.mlp_head(torch.cat([dir_enc, feat], -1)).float()
        return rgb, density


def render_rays(field, estimator, rays_o, rays_d, step_size, bkgd, stratified):
    def sigma_fn(t_starts, t_ends, ray_indices):
        pos = rays_o[ray_indices] + rays_d[ray_indices] * ((t_starts + t_ends) / 2.0)[:, None]
        return field.query_density(pos).squeeze(-1)

    def rgb_sigma_fn(t_starts, t_ends, ray_indices):
        t_d = rays_d[ray_indices]
        pos = rays_o[ray_indices] + t_d * ((t_starts + t_ends) / 2.0)[:, None]
        rgb, sigma = field(pos, t_d)
        return rgb, sigma.squeeze(-1)

    ray_indices, t_starts, t_ends = estimator.sampling(rays_o, rays_d, sigma_fn=sigma_fn, near_plane=0.0, far_plane=1e10,
                                                       render_step_size=step_size, stratified=stratified, alpha_thre=0.0)
    rgb, opacity, depth, _ = rendering(t_starts, t_ends, ray_indices, n_rays=rays_o.shape[0],
                                       rgb_sigma_fn=rgb_sigma_fn, render_bkgd=bkgd)
    return rgb, opacity, depth, t_starts.shape[0]


def camera_rays(poses, ids, xs, ys, W, H, focal):
    c2w = poses[ids]
    d = torch.stack([(xs + 0.5 - 0.5 * W) / focal, -(ys + 0.5 - 0.5 * H) / focal, -torch.ones_like(xs, dtype=torch.float32)], -1)
    d = (c2w[:, :3, :3] @ d[..., None]).squeeze(-1)
    return c2w[:, :3, 3], F.normalize(d, dim=-1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    imgs, poses, H, W, focal = load(args.data_root, args.scene, "train")
    test_imgs, test_poses, _, _, _ = load(args.data_root, args.scene, "test")
    imgs, poses, test_poses = imgs.to(device), poses.to(device), test_poses.to(device)

    aabb = torch.tensor([-1.5, -1.5, -1.5, 1.5, 1.5, 1.5], device=device)
    render_step_size = (aabb[3:] - aabb[:3]).max().item() * math.sqrt(3) / 1024
    estimator = OccGridEstimator(roi_aabb=aabb, resolution=args.grid_resolution, levels=1).to(device)
    field = NGPRadianceField(aabb).to(device)
    model = DDP(field, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-15, weight_decay=1e-6)
    scheduler = torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=100),
        torch.optim.lr_scheduler.MultiStepLR(optimizer, [args.max_steps // 2, args.max_steps * 3 // 4, args.max_steps * 9 // 10], 0.33)])
    grad_scaler = torch.cuda.amp.GradScaler(2 ** 10)
    lpips_fn = LPIPS(net="vgg").to(device)

    num_rays = args.init_batch_size
    target_samples = args.target_sample_batch_size // world
    tic = time.time()
    for step in range(args.max_steps + 1):
        model.train()

        def occ_eval_fn(x):
            return field.query_density(x) * render_step_size

        # same random cells on every rank so that the grids stay identical
        with torch.random.fork_rng(devices=[device]):
            torch.manual_seed(args.seed + step)
            estimator.update_every_n_steps(step=step, occ_eval_fn=occ_eval_fn, occ_thre=1e-2)

        ids = torch.randint(0, imgs.shape[0], (num_rays,), device=device)
        xs = torch.randint(0, W, (num_rays,), device=device)
        ys = torch.randint(0, H, (num_rays,), device=device)
        rays_o, rays_d = camera_rays(poses, ids, xs, ys, W, H, focal)
        rgba = imgs[ids, ys, xs]
        bkgd = torch.rand(3, device=device)
        pixels = rgba[:, :3] * rgba[:, 3:] + bkgd * (1.0 - rgba[:, 3:])

        rgb, acc, depth, n_samples = render_rays(model, estimator, rays_o, rays_d, render_step_size, bkgd, stratified=True)
        if n_samples == 0:
            n_samples = 1
        num_rays = min(int(num_rays * (target_samples / float(n_samples))), 1 << 16)

        loss = F.smooth_l1_loss(rgb, pixels)
        optimizer.zero_grad()
        grad_scaler.scale(loss).backward()
        optimizer.step()
        scheduler.step()

        if step % 1000 == 0:
            stats = torch.tensor([loss.item(), F.mse_loss(rgb, pixels).item(), float(n_samples)], device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} | {time.time() - tic:.1f}s | loss {stats[0]:.5f} | "
                      f"psnr {-10 * math.log10(stats[1]):.2f} | samples/rank {int(stats[2])} | rays {num_rays}", flush=True)

        if step > 0 and step % 5000 == 0 or step == args.max_steps:
            model.eval()
            metrics = torch.zeros(3, device=device)
            with torch.no_grad():
                for i in range(rank, test_imgs.shape[0], world):
                    yy, xx = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
                    ro, rd = camera_rays(test_poses, torch.full((H * W,), i, device=device), xx.flatten(), yy.flatten(), W, H, focal)
                    white = torch.ones(3, device=device)
                    rgb = torch.cat([render_rays(field, estimator, ro[s:s + 8192], rd[s:s + 8192], render_step_size, white, False)[0]
                                     for s in range(0, ro.shape[0], 8192)]).view(H, W, 3)
                    gt_rgba = test_imgs[i].to(device)
                    gt = gt_rgba[..., :3] * gt_rgba[..., 3:] + (1 - gt_rgba[..., 3:])
                    metrics[0] += -10 * torch.log10(F.mse_loss(rgb, gt))
                    metrics[1] += lpips_fn(rgb.permute(2, 0, 1)[None] * 2 - 1, gt.permute(2, 0, 1)[None] * 2 - 1).squeeze()
                    metrics[2] += 1
            dist.all_reduce(metrics)
            if rank == 0:
                print(f"eval @ {step}: psnr {metrics[0] / metrics[2]:.2f} lpips {metrics[1] / metrics[2]:.4f}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"field": field.state_dict(), "estimator": estimator.state_dict(), "step": step},
                           os.path.join(args.out, f"{args.scene}_{step:06d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
