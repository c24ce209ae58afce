#!/usr/bin/env python
"""Instant-NGP style training on Blender synthetic scenes, data parallel over GPUs.

Hash-grid field from tiny-cuda-nn, ray marching with nerfacc's occupancy grid.

    torchrun --nproc_per_node=8 train_ngp_ddp.py --data_dir data/nerf_synthetic/lego --exp lego
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

import nerfacc
import tinycudann as tcnn
from nerfacc.estimators.occ_grid import OccGridEstimator


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--exp", default="ngp")
    p.add_argument("--log_root", default="logs")
    p.add_argument("--max_steps", type=int, default=20000)
    p.add_argument("--batch_rays", type=int, default=16384, help="rays per step over all GPUs")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--aabb", type=float, default=1.5)
    p.add_argument("--grid_res", type=int, default=128)
    p.add_argument("--render_step_size", type=float, default=5e-3)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--n_eval_views", type=int, default=8)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class _TruncExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.exp(x.clamp(-15, 15))


trunc_exp = _TruncExp.apply


class NGPField(nn.Module):
    def __init__(self, aabb):
        super().__init__()
        self.register_buffer("aabb", torch.tensor([-aabb, -aabb, -aabb, aabb, aabb, aabb]))
        self.pos_enc = tcnn.Encoding(3, {
            "otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2,
            "log2_hashmap_size": 19, "base_resolution": 16, "per_level_scale": 1.4472692,
        })
        self.sigma_mlp = tcnn.Network(self.pos_enc.n_output_dims, 16, {
            "otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
            "n_neurons": 64, "n_hidden_layers": 1,
        })
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.rgb_mlp = tcnn.Network(15 + self.dir_enc.n_output_dims, 3, {
            "otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "Sigmoid",
            "n_neurons": 64, "n_hidden_layers": 2,
        })

    def _normalize(self, x):
        lo, hi = self.aabb[:3], self.aabb[3:]
        return (x - lo) / (hi - lo)

    def query_density(self, x, return_feat=False):
        xn = self._normalize(x)
        inside = ((xn > 0) & (xn < 1)).all(dim=-1)
        h = self.sigma_mlp(self.pos_enc(xn.view(-1, 3))).view(*x.shape[:-1], 16)
        sigma = trunc_exp(h[..., 0].float()) * inside
        if return_feat:
            return sigma, h[..., 1:]
        return sigma

    def forward(self, x, d):
        sigma, feat = self.query_density(x, return_feat=True)
        d_enc = self.dir_enc(((d + 1.0) / 2.0).view(-1, 3))
        rgb = self.rgb_mlp(torch.cat([feat.view(-1, 15), d_enc], dim=-1)).view(*x.shape[:-1], 3)
        return rgb.float(), sigma


def load_split(root, split):
    with open(os.path.join(root, f"transforms_{split}.json")) as f:
        meta = json.load(f)
    imgs, poses = [], []
    for fr in meta["frames"]:
        im = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        imgs.append(im)
        poses.append(np.asarray(fr["transform_matrix"], dtype=np.float32))
    imgs = torch.from_numpy(np.stack(imgs))
    poses = torch.from_numpy(np.stack(poses))
    H, W = imgs.shape[1:3]
    focal = 0.5 * W / math.tan(0.5 * float(meta["camera_angle_x"]))
    return imgs, poses, H, W, focal


def pixel_rays(c2w, xs, ys, H, W, focal):
    dirs = torch.stack([(xs + 0.5 - 0.5 * W) / focal, -(ys + 0.5 - 0.5 * H) / focal, -torch.ones_like(xs)], -1)
    rays_d = (dirs[:, None, :] * c2w[:, :3, :3]).sum(-1)
    rays_d = F.normalize(rays_d, dim=-1)
    rays_o = c2w[:, :3, 3].expand_as(rays_d)
    return rays_o, rays_d


def render_rays(model, field, estimator, rays_o, rays_d, bkgd, step_size, train):
    def sigma_fn(t_starts, t_ends, ray_indices):
        o, d = rays_o[ray_indices], rays_d[ray_indices]
        x = o + d * (t_starts + t_ends)[:, None] / 2.0
        return field.query_density(x)

    def rgb_sigma_fn(t_starts, t_ends, ray_indices):
        o, d = rays_o[ray_indices], rays_d[ray_indices]
        x = o + d * (t_starts + t_ends)[:, None] / 2.0
        return model(x, d)

    ray_indices, t_starts, t_ends = estimator.sampling(
        rays_o, rays_d, sigma_fn=sigma_fn, near_plane=0.0, far_plane=1e10,
        render_step_size=step_size, stratified=train, alpha_thre=0.0,
    )
    rgb, acc, depth, _ = nerfacc.rendering(
        t_starts, t_ends, ray_indices, n_rays=rays_o.shape[0],
        rgb_sigma_fn=rgb_sigma_fn, render_bkgd=bkgd,
    )
    return rgb, acc, depth, len(t_starts)


@torch.no_grad()
def evaluate(field, estimator, imgs, poses, H, W, focal, step_size, device, n_views):
    field.eval()
    estimator.eval()
    psnrs = []
    bkgd = torch.ones(3, device=device)
    ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
    xs, ys = xs.reshape(-1).float(), ys.reshape(-1).float()
    for i in range(min(n_views, len(imgs))):
        c2w = poses[i].to(device)[None].expand(xs.shape[0], 4, 4)
        rays_o, rays_d = pixel_rays(c2w, xs, ys, H, W, focal)
        out = []
        for s in range(0, rays_o.shape[0], 8192):
            rgb, _, _, _ = render_rays(field, field, estimator, rays_o[s:s + 8192], rays_d[s:s + 8192],
                                       bkgd, step_size, train=False)
            out.append(rgb)
        pred = torch.cat(out).view(H, W, 3)
        gt = imgs[i].to(device)
        gt = gt[..., :3] * gt[..., 3:] + (1.0 - gt[..., 3:])
        psnrs.append(-10.0 * torch.log10(F.mse_loss(pred, gt)).item())
    field.train()
    estimator.train()
    return float(np.mean(psnrs))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # same global seed everywhere (identical init); per-rank generator for ray sampling
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    ray_gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * rank)

    log_dir = os.path.join(args.log_root, args.exp)
    writer = None
    if rank == 0:
        os.makedirs(log_dir, exist_ok=True)
        writer = SummaryWriter(log_dir)

    train_imgs, train_poses, H, W, focal = load_split(args.data_dir, "train")
    test_imgs, test_poses, _, _, _ = load_split(args.data_dir, "test")
    train_imgs = train_imgs.to(device)
    train_poses = train_poses.to(device)

    field = NGPField(args.aabb).to(device)
    estimator = OccGridEstimator(roi_aabb=field.aabb, resolution=args.grid_res, levels=1).to(device)
    model = DDP(field, device_ids=[local_rank])

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-15)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[args.max_steps // 2, args.max_steps * 3 // 4, args.max_steps * 9 // 10], gamma=0.33)
    scaler = torch.cuda.amp.GradScaler(2 ** 10)

    rays_per_rank = args.batch_rays // world_size
    n_train = train_imgs.shape[0]

    def occ_eval_fn(x):
        return model.query_density(x) * args.render_step_size

    t0 = time.time()
    for step in range(1, args.max_steps + 1):
        model.train()
        estimator.train()

        estimator.update_every_n_steps(step=step, occ_eval_fn=occ_eval_fn, occ_thre=1e-2)
        if step % 16 == 0:
            # grids are refreshed from random points in each cell; keep every rank on the same one
            dist.all_reduce(estimator.occs, op=dist.ReduceOp.MAX)
            thre = torch.clamp(estimator.occs.mean(), max=1e-2)
            estimator.binaries = (estimator.occs > thre).view(estimator.binaries.shape)

        img_idx = torch.randint(0, n_train, (rays_per_rank,), device=device, generator=ray_gen)
        xs = torch.randint(0, W, (rays_per_rank,), device=device, generator=ray_gen)
        ys = torch.randint(0, H, (rays_per_rank,), device=device, generator=ray_gen)
        rays_o, rays_d = pixel_rays(train_poses[img_idx], xs.float(), ys.float(), H, W, focal)
        px = train_imgs[img_idx, ys, xs]
        bkgd = torch.rand(3, device=device, generator=ray_gen)
        target = px[:, :3] * px[:, 3:] + bkgd * (1.0 - px[:, 3:])

        rgb, acc, depth, n_samples = render_rays(model, field, estimator, rays_o, rays_d, bkgd,
                                                 args.render_step_size, train=True)
        loss = F.smooth_l1_loss(rgb, target)

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

        if step % 100 == 0:
            loss_t = loss.detach().clone()
            dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
            if rank == 0:
                psnr = -10.0 * math.log10(F.mse_loss(rgb.detach(), target).item() + 1e-10)
                writer.add_scalar("train/loss", loss_t.item(), step)
                writer.add_scalar("train/psnr_rank0", psnr, step)
                writer.add_scalar("train/samples_per_ray", n_samples / rays_per_rank, step)
                print(f"[{step:6d}] loss={loss_t.item():.5f} psnr={psnr:.2f} "
                      f"samples={n_samples} t={time.time() - t0:.1f}s", flush=True)

        if step % args.eval_every == 0 or step == args.max_steps:
            if rank == 0:
                psnr = evaluate(field, estimator, test_imgs, test_poses, H, W, focal,
                                args.render_step_size, device, args.n_eval_views)
                writer.add_scalar("test/psnr", psnr, step)
                print(f"step {step}: test PSNR {psnr:.2f}", flush=True)
                torch.save({
                    "step": step,
                    "field": field.state_dict(),
                    "estimator": estimator.state_dict(),
                    "optimizer": optimizer.state_dict(),
                }, os.path.join(log_dir, f"ckpt_{step:06d}.pt"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
