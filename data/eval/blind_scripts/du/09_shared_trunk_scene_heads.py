"""Shared-geometry-prior NeRF: one trunk for all scenes, a small head per scene.

The trunk learns a prior over indoor scenes (ScanNet++ / Replica style captures
in nerfstudio format); every scene has its own density + colour head. Each step
a GPU draws one scene and a batch of rays from it.

    torchrun --nnodes=1 --nproc_per_node=8 09_shared_trunk_scene_heads.py --cfg cfg/replica_prior.yaml
"""
import argparse
import json
import math
import os
import random

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP


def load_nerfstudio_scene(path, downscale):
    with open(os.path.join(path, "transforms.json")) as f:
        meta = json.load(f)
    imgs, c2ws = [], []
    for fr in meta["frames"][::downscale]:
        imgs.append(imageio.imread(os.path.join(path, fr["file_path"]))[..., :3])
        c2ws.append(np.array(fr["transform_matrix"], dtype=np.float32))
    K = torch.tensor([meta["fl_x"], meta["fl_y"], meta["cx"], meta["cy"]], dtype=torch.float32)
    imgs = torch.from_numpy(np.stack(imgs))  # uint8, kept compact
    return {"imgs": imgs, "c2w": torch.from_numpy(np.stack(c2ws)), "K": K, "name": os.path.basename(path)}


def fourier(x, n):
    freqs = 2.0 ** torch.arange(n, device=x.device) * math.pi
    xf = (x[..., None] * freqs).flatten(-2)
    return torch.cat([x, xf.sin(), xf.cos()], -1)


class SceneHead(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.sigma = nn.Sequential(nn.Linear(width, 64), nn.ReLU(True), nn.Linear(64, 1))
        self.rgb = nn.Sequential(nn.Linear(width + 27, 128), nn.ReLU(True), nn.Linear(128, 3), nn.Sigmoid())

    def forward(self, h, d):
        return self.rgb(torch.cat([h, d], -1)), F.softplus(self.sigma(h).squeeze(-1) - 1.0)


class PriorNeRF(nn.Module):
    def __init__(self, n_scenes, width=256, depth=8, n_freq=10):
        super().__init__()
        self.n_freq = n_freq
        d_in = 3 + 6 * n_freq
        layers = [nn.Linear(d_in, width)]
        for _ in range(depth - 1):
            layers += [nn.ReLU(True), nn.Linear(width, width)]
        self.trunk = nn.Sequential(*layers, nn.ReLU(True))
        self.heads = nn.ModuleList([SceneHead(width) for _ in range(n_scenes)])

    def forward(self, rays_o, rays_d, scene, near, far, n_samples):
        t = torch.linspace(0, 1, n_samples, device=rays_o.device)
        z = near + (far - near) * t
        z = z + torch.rand(rays_o.shape[0], n_samples, device=rays_o.device) * (far - near) / n_samples
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        h = self.trunk(fourier(pts, self.n_freq))
        d = fourier(F.normalize(rays_d, dim=-1), 4)[:, None].expand(-1, n_samples, -1)
        rgb, sigma = self.heads[scene](h, d)
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), (w * z).sum(1)


def sample_batch(scene, n, device):
    imgs, c2w, K = scene["imgs"], scene["c2w"], scene["K"]
    V, H, W = imgs.shape[:3]
    v = torch.randint(0, V, (n,))
    x = torch.randint(0, W, (n,))
    y = torch.randint(0, H, (n,))
    d = torch.stack([(x + 0.5 - K[2]) / K[0], -(y + 0.5 - K[3]) / K[1], -torch.ones(n)], -1)
    d = (c2w[v, :3, :3] @ d[..., None]).squeeze(-1)
    o = c2w[v, :3, 3]
    rgb = imgs[v, y, x].float() / 255.0
    return o.to(device), d.to(device), rgb.to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cli = ap.parse_args()
    with open(cli.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"] + rank)

    scene_paths = sorted(os.path.join(cfg["root"], s) for s in cfg["scenes"])
    scenes = [load_nerfstudio_scene(p, cfg.get("frame_stride", 1)) for p in scene_paths]
    model = PriorNeRF(len(scenes), width=cfg["width"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, cfg["iters"], eta_min=cfg["lr"] * 0.01)

    if rank == 0:
        wandb.init(project="nerf-prior", config=cfg, name=cfg.get("run_name"))
        os.makedirs(cfg["out_dir"], exist_ok=True)

    rays_per_gpu = cfg["rays_per_step"] // world
    for it in range(1, cfg["iters"] + 1):
        s = random.randrange(len(scenes))
        o, d, gt = sample_batch(scenes[s], rays_per_gpu, device)
        rgb, depth = model(o, d, s, cfg["near"], cfg["far"], cfg["n_samples"])
        loss = F.mse_loss(rgb, gt)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if it % 100 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                wandb.log({"train/mse": l.item(), "train/psnr": -10 * math.log10(l.item()),
                           "lr": sched.get_last_lr()[0]}, step=it)

        if it % cfg["val_every"] == 0:
            # quick random-pixel PSNR estimate per scene, scenes split over ranks
            net = model.module
            stats = torch.zeros(len(scenes), 2, device=device)
            with torch.no_grad():
                for si in range(rank, len(scenes), world):
                    o, d, gt = sample_batch(scenes[si], 8192, device)
                    pred, _ = net(o, d, si, cfg["near"], cfg["far"], cfg["n_samples"])
                    stats[si, 0] = -10 * torch.log10(F.mse_loss(pred, gt))
                    stats[si, 1] = 1
            dist.all_reduce(stats)
            if rank == 0:
                wandb.log({f"val/psnr_{scenes[i]['name']}": stats[i, 0].item() for i in range(len(scenes))
                           if stats[i, 1] > 0}, step=it)

        if it % cfg["ckpt_every"] == 0:
            if rank == 0:
                torch.save({"it": it, "model": model.module.state_dict(), "optim": optim.state_dict(),
                            "scenes": [sc["name"] for sc in scenes]},
                           os.path.join(cfg["out_dir"], f"prior_{it:07d}.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
