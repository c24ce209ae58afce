#!/usr/bin/env python
"""Train a hash-grid radiance field on a phone capture processed with
`ns-process-data` (nerfstudio transforms.json: fl_x, fl_y, cx, cy, w, h, frames).

    torchrun --nproc_per_node=4 train_capture.py --data captures/kitchen --val_frac 0.1
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import tinycudann as tcnn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics.functional.image import structural_similarity_index_measure


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="outputs")
    ap.add_argument("--downscale", type=int, default=2)
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--rays", type=int, default=16384, help="global rays per step")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--val_every", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def load_capture(root, downscale):
    meta = json.load(open(os.path.join(root, "transforms.json")))
    frames = sorted(meta["frames"], key=lambda f: f["file_path"])
    imgs, c2ws = [], []
    for fr in frames:
        im = Image.open(os.path.join(root, fr["file_path"])).convert("RGB")
        im = im.resize((im.width // downscale, im.height // downscale), Image.BILINEAR)
        imgs.append(np.asarray(im, np.uint8))
        c2ws.append(np.array(fr["transform_matrix"], np.float32))
    intr = torch.tensor([meta["fl_x"], meta["fl_y"], meta["cx"], meta["cy"]], dtype=torch.float32) / downscale
    c2ws = np.stack(c2ws)
    # fit the cameras in a [-1, 1] box
    center = c2ws[:, :3, 3].mean(0)
    scale = 1.0 / np.abs(c2ws[:, :3, 3] - center).max()
    c2ws[:, :3, 3] = (c2ws[:, :3, 3] - center) * scale
    return torch.from_numpy(np.stack(imgs)), torch.from_numpy(c2ws), intr


def get_rays(c2w, intr, px, py):
    fx, fy, cx, cy = intr
    d = torch.stack([(px + 0.5 - cx) / fx, -(py + 0.5 - cy) / fy, -torch.ones_like(px)], -1)
    rd = F.normalize((c2w[..., :3, :3] @ d[..., None]).squeeze(-1), dim=-1)
    return c2w[..., :3, 3].expand_as(rd), rd


class Field(nn.Module):
    def __init__(self, bound=2.0):
        super().__init__()
        self.bound = bound
        self.geo = tcnn.NetworkWithInputEncoding(
            3, 16,
            {"otype": "HashGrid", "n_levels": 16, "n_features_per_level": 2, "log2_hashmap_size": 20,
             "base_resolution": 16, "per_level_scale": 1.5},
            {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
             "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.head = tcnn.Network(15 + 16, 3, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                              "output_activation": "Sigmoid", "n_neurons": 64, "n_hidden_layers": 2})

    def forward(self, x, d):
        h = self.geo(((x / self.bound) + 1) / 2).float()
        sigma = torch.exp(h[:, 0].clamp(max=15))
        rgb = self.head(torch.cat([h[:, 1:], self.dir_enc((d + 1) / 2).float()], -1)).float()
        return rgb, sigma


def render(field, ro, rd, n, perturb):
    # rays clipped to the [-bound, bound] box
    inv = 1.0 / torch.where(rd.abs() < 1e-8, torch.full_like(rd, 1e-8), rd)
    t0, t1 = (-field_bound(field) - ro) * inv, (field_bound(field) - ro) * inv
    near = torch.minimum(t0, t1).max(-1).values.clamp_min(0.05)
    far = torch.maximum(t0, t1).min(-1).values.clamp_min(near + 1e-3)
    u = torch.linspace(0, 1, n, device=ro.device)
    t = near[:, None] + (far - near)[:, None] * u
    if perturb:
        t = t + torch.rand_like(t) * ((far - near) / n)[:, None]
    pts = ro[:, None] + rd[:, None] * t[..., None]
    rgb, sigma = field(pts.view(-1, 3), rd[:, None].expand(-1, n, -1).reshape(-1, 3))
    rgb, sigma = rgb.view(-1, n, 3), sigma.view(-1, n)
    delta = torch.cat([t[:, 1:] - t[:, :-1], torch.full_like(t[:, :1], 1e10)], -1)
    a = 1 - torch.exp(-sigma * delta)
    w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
    return (w[..., None] * rgb).sum(1), w


def field_bound(field):
    return field.module.bound if isinstance(field, DDP) else field.bound


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different seed per rank so the ranks draw different rays
    seed_all(args.seed + rank)

    imgs, c2ws, intr = load_capture(args.data, args.downscale)
    n = imgs.shape[0]
    n_val = max(1, int(round(n * args.val_frac)))
    perm = np.random.permutation(n)
    val_ids, train_ids = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    H, W = imgs.shape[1:3]
    train_imgs = imgs[train_ids].to(device)
    train_c2w = c2ws[train_ids].to(device)
    intr = intr.to(device)
    if rank == 0:
        print(f"{len(train_ids)} train / {len(val_ids)} val frames at {W}x{H}, {world} GPUs", flush=True)

    model = DDP(Field().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-15)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.01 ** (1 / args.steps))
    per_rank = args.rays // world
    os.makedirs(args.out, exist_ok=True)

    t_start = time.time()
    for step in range(1, args.steps + 1):
        i = torch.randint(0, len(train_ids), (per_rank,), device=device)
        px = torch.randint(0, W, (per_rank,), device=device)
        py = torch.randint(0, H, (per_rank,), device=device)
        ro, rd = get_rays(train_c2w[i], intr, px.float(), py.float())
        target = train_imgs[i, py, px].float() / 255.0
        rgb, w = render(model, ro, rd, args.samples, perturb=True)
        loss = F.mse_loss(rgb, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

        if step % 250 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} psnr {-10 * math.log10(l.item()):.2f} ({time.time() - t_start:.0f}s)", flush=True)

        if step % args.val_every == 0 or step == args.steps:
            field = model.module
            acc = torch.zeros(3, device=device)
            yy, xx = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
            with torch.no_grad():
                for k in val_ids[rank::world]:
                    ro, rd = get_rays(c2ws[k].to(device).expand(H * W, 4, 4), intr, xx.reshape(-1).float(), yy.reshape(-1).float())
                    pred = torch.cat([render(field, ro[s:s + 32768], rd[s:s + 32768], args.samples, False)[0]
                                      for s in range(0, H * W, 32768)]).view(H, W, 3)
                    gt = imgs[k].to(device).float() / 255.0
                    acc[0] += -10 * torch.log10(F.mse_loss(pred, gt))
                    acc[1] += structural_similarity_index_measure(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None],
                                                                  data_range=1.0)
                    acc[2] += 1
            dist.all_reduce(acc)
            if rank == 0:
                print(f"[val {step}] PSNR {acc[0].item() / acc[2].item():.2f}  SSIM {acc[1].item() / acc[2].item():.4f}",
                      flush=True)
                torch.save({"step": step, "field": field.state_dict(), "val_ids": val_ids.tolist()},
                           os.path.join(args.out, "field.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
