"""Hash-grid NeRF (tiny-cuda-nn) on Blender scenes, trained with DDP over shuffled rays.

Usage:
    torchrun --nproc_per_node=4 train_ngp.py --root data/nerf_synthetic/chair --exp chair_ngp
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import tinycudann as tcnn
import wandb


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--out", default="runs")
    ap.add_argument("--batch_rays", type=int, default=8192, help="rays per step over all GPUs")
    ap.add_argument("--num_samples", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--downscale", type=int, default=1)
    ap.add_argument("--no_wandb", action="store_true")
    return ap.parse_args()


class BlenderRays(Dataset):
    """All rays of all training views, flattened; one item is one ray."""

    def __init__(self, root, split, downscale, device):
        with open(os.path.join(root, f"transforms_{split}.json")) as f:
            meta = json.load(f)
        rgbs, poses = [], []
        for fr in meta["frames"]:
            img = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
            if downscale > 1:
                img = img[::downscale, ::downscale]
            img = img[..., :3] * img[..., 3:] + (1.0 - img[..., 3:])   # white background
            rgbs.append(img)
            poses.append(np.array(fr["transform_matrix"], dtype=np.float32)[:3, :4])
        self.H, self.W = rgbs[0].shape[:2]
        self.focal = 0.5 * self.W / math.tan(0.5 * meta["camera_angle_x"])
        self.poses = torch.from_numpy(np.stack(poses))
        # building rays for 100 views of 800x800 in numpy takes minutes, do it on the GPU
        self.all_rays = self._rays(self.poses.to(device))
        self.all_rgbs = torch.from_numpy(np.stack(rgbs)).reshape(-1, 3).to(device)

    def _rays(self, poses):
        dev = poses.device
        j, i = torch.meshgrid(torch.arange(self.H, device=dev), torch.arange(self.W, device=dev), indexing="ij")
        dirs = torch.stack([(i + 0.5 - self.W / 2) / self.focal, -(j + 0.5 - self.H / 2) / self.focal,
                            -torch.ones_like(i, dtype=torch.float32)], -1)
        rays_d = torch.einsum("hwc,nrc->nhwr", dirs, poses[:, :, :3])
        rays_o = poses[:, None, None, :, 3].expand_as(rays_d)
        return torch.cat([rays_o, F.normalize(rays_d, dim=-1)], -1).reshape(-1, 6)

    def __len__(self):
        return self.all_rays.shape[0]

    def __getitem__(self, idx):
        return {"rays": self.all_rays[idx], "rgbs": self.all_rgbs[idx]}


class HashNeRF(nn.Module):
    def __init__(self, bound=1.5):
        super().__init__()
        self.bound = bound
        self.sigma_net = tcnn.NetworkWithInputEncoding(
            n_input_dims=3, n_output_dims=16,
            encoding_config={"otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2,
                             "log2_hashmap_size": 19, "base_resolution": 16, "per_level_scale": 1.447},
            network_config={"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                             "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.color_net = tcnn.Network(
            n_input_dims=self.dir_enc.n_output_dims + 15, n_output_dims=3,
            network_config={"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "Sigmoid",
                            "n_neurons": 64, "n_hidden_layers": 2})

    def forward(self, x, d):
        x = (x + self.bound) / (2 * self.bound)
        h = self.sigma_net(x.clamp(0, 1)).float()
        sigma = F.softplus(h[:, :1] - 1.0)
        rgb = self.color_net(torch.cat([self.dir_enc((d + 1) / 2), h[:, 1:]], -1)).float()
        return sigma, rgb


def render_rays(model, rays, num_samples, near=2.0, far=6.0, perturb=True):
    o, d = rays[:, :3], rays[:, 3:]
    n = rays.shape[0]
    t = torch.linspace(near, far, num_samples + 1, device=rays.device)
    t = t[:-1].expand(n, -1)
    step = (far - near) / num_samples
    if perturb:
        t = t + torch.rand_like(t) * step
    else:
        t = t + 0.5 * step
    pts = o[:, None] + d[:, None] * t[..., None]
    sigma, rgb = model(pts.reshape(-1, 3), d[:, None].expand_as(pts).reshape(-1, 3))
    sigma, rgb = sigma.view(n, num_samples), rgb.view(n, num_samples, 3)
    alpha = 1 - torch.exp(-sigma * step)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], 1), 1)[:, :-1]
    w = alpha * trans
    color = (w[..., None] * rgb).sum(1) + (1 - w.sum(1, keepdim=True))
    return color, w


@torch.no_grad()
def eval_view(model, ds, pose, num_samples, device, chunk=8192):
    rays = ds._rays(pose[None].to(device))
    out = torch.cat([render_rays(model, rays[i:i + chunk], num_samples, perturb=False)[0]
                     for i in range(0, rays.shape[0], chunk)])
    return out.view(ds.H, ds.W, 3)


def main():
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    out_dir = os.path.join(args.out, args.exp)
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        if not args.no_wandb:
            wandb.init(project="ngp-blender", name=args.exp, config=vars(args))

    train_ds = BlenderRays(args.root, "train", args.downscale, device)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_rays // world, sampler=sampler,
                        num_workers=args.num_workers, drop_last=True)

    model = HashNeRF().to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-15)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.1 ** min(s / total, 1.0))

    val_ds, val_pose = None, None
    if is_main:
        with open(os.path.join(args.root, "transforms_val.json")) as f:
            fr = json.load(f)["frames"][0]
        val_pose = torch.tensor(fr["transform_matrix"], dtype=torch.float32)[:3, :4]
        val_gt = imageio.imread(os.path.join(args.root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        val_gt = val_gt[::args.downscale, ::args.downscale]
        val_gt = torch.from_numpy(val_gt[..., :3] * val_gt[..., 3:] + 1 - val_gt[..., 3:]).to(device)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in loader:
            rays = batch["rays"].to(device, non_blocking=True)
            rgbs = batch["rgbs"].to(device, non_blocking=True)
            pred, _ = render_rays(model, rays, args.num_samples)
            loss = F.mse_loss(pred, rgbs)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if is_main:
                    psnr = -10 * math.log10(l.item())
                    print(f"ep {epoch} step {step} loss {l.item():.5f} psnr {psnr:.2f} ({time.time() - t0:.0f}s)")
                    if not args.no_wandb:
                        wandb.log({"train/loss": l.item(), "train/psnr": psnr,
                                   "lr": sched.get_last_lr()[0]}, step=step)

        if is_main:
            img = eval_view(model.module, train_ds, val_pose, args.num_samples, device)
            val_psnr = -10 * math.log10(F.mse_loss(img, val_gt).item())
            print(f"epoch {epoch}: val psnr {val_psnr:.2f}")
            imageio.imwrite(os.path.join(out_dir, f"val_{epoch:03d}.png"),
                            (img.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8))
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "step": step, "epoch": epoch}, os.path.join(out_dir, "last.ckpt"))
            if not args.no_wandb:
                wandb.log({"val/psnr": val_psnr}, step=step)
        dist.barrier()

    if is_main and not args.no_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
