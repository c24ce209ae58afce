"""Fit per-object triplanes with one shared MLP decoder (e.g. Objaverse renders).

The objects are divided among ranks: every rank owns the triplanes of its
objects (plain local parameters) and the shared decoder is trained with DDP.

    torchrun --nproc_per_node=8 fit_triplanes.py --root /data/objaverse_renders --list splits/train_2k.txt
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--list", required=True)
    ap.add_argument("--out", default="triplane_fit")
    ap.add_argument("--plane_res", type=int, default=128)
    ap.add_argument("--plane_ch", type=int, default=32)
    ap.add_argument("--views_per_step", type=int, default=8, help="views per GPU per step")
    ap.add_argument("--rays", type=int, default=1024, help="rays per view")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr_decoder", type=float, default=1e-3)
    ap.add_argument("--lr_planes", type=float, default=1e-2)
    ap.add_argument("--tv_weight", type=float, default=1e-4)
    return ap.parse_args()


class ObjectViews(Dataset):
    """One item = one rendered view of one object, with `rays` random pixels of it.

    Objects do not all have the same number of views: renders that failed the
    alpha / exposure checks were dropped by the preprocessing script.
    """

    def __init__(self, root, objs, rays):
        self.items = []
        for k, o in enumerate(objs):
            meta = json.load(open(os.path.join(root, o, "transforms.json")))
            for fr in meta["frames"]:
                self.items.append((k, os.path.join(root, o, fr["file_path"]),
                                   np.array(fr["transform_matrix"], np.float32), meta["camera_angle_x"]))
        self.rays = rays

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        k, path, c2w, fov = self.items[idx]
        im = np.asarray(Image.open(path), np.float32) / 255.0
        rgb = im[..., :3] * im[..., 3:] + (1 - im[..., 3:])
        H, W = rgb.shape[:2]
        focal = 0.5 * W / math.tan(0.5 * fov)
        pix = np.random.randint(0, H * W, self.rays)
        x, y = (pix % W).astype(np.float32), (pix // W).astype(np.float32)
        d = np.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -np.ones_like(x)], -1) @ c2w[:3, :3].T
        o = np.broadcast_to(c2w[:3, 3], d.shape)
        rays = np.concatenate([o, d], -1).astype(np.float32)
        return torch.from_numpy(rays), torch.from_numpy(rgb.reshape(-1, 3)[pix]), k


class Decoder(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ch, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 4))

    def forward(self, feat):
        out = self.net(feat)
        return torch.sigmoid(out[..., :3]) * 1.002 - 0.001, F.softplus(out[..., 3] - 1.0)


def sample_triplane(planes, pts):
    # planes: (B, 3, C, R, R), pts: (B, N, 3) in [-1, 1]
    B, _, C, R, _ = planes.shape
    coords = torch.stack([pts[..., [0, 1]], pts[..., [0, 2]], pts[..., [1, 2]]], 1)  # B,3,N,2
    f = F.grid_sample(planes.flatten(0, 1), coords.flatten(0, 1)[:, :, None], align_corners=False, mode="bilinear")
    return f.view(B, 3, C, -1).sum(1).permute(0, 2, 1)  # B,N,C


def render(decoder, planes, rays, n_samples, near=0.6, far=2.4, perturb=True):
    # rays: (B, R, 6); planes: (B, 3, C, res, res)
    ro, rd = rays[..., :3], rays[..., 3:]
    t = torch.linspace(near, far, n_samples, device=rays.device).expand(*ro.shape[:2], n_samples)
    if perturb:
        t = t + torch.rand_like(t) * (far - near) / n_samples
    pts = ro[..., None, :] + rd[..., None, :] * t[..., None]
    B, Rn, S, _ = pts.shape
    feat = sample_triplane(planes, (pts / 1.0).clamp(-1, 1).view(B, -1, 3))
    rgb, sigma = decoder(feat)
    rgb, sigma = rgb.view(B, Rn, S, 3), sigma.view(B, Rn, S)
    delta = torch.cat([t[..., 1:] - t[..., :-1], torch.full_like(t[..., :1], 1e10)], -1)
    a = 1 - torch.exp(-sigma * delta)
    w = a * torch.cumprod(torch.cat([torch.ones_like(a[..., :1]), 1 - a + 1e-10], -1), -1)[..., :-1]
    return (w[..., None] * rgb).sum(-2) + (1 - w.sum(-1, keepdim=True))


def tv_loss(p):
    return (p[..., 1:, :] - p[..., :-1, :]).pow(2).mean() + (p[..., :, 1:] - p[..., :, :-1]).pow(2).mean()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    with open(args.list) as f:
        all_objs = [l.strip() for l in f if l.strip()]
    my_objs = all_objs[rank::world]
    dataset = ObjectViews(args.root, my_objs, args.rays)
    loader = DataLoader(dataset, batch_size=args.views_per_step, shuffle=True,
                        num_workers=6, pin_memory=True, drop_last=True)

    planes = nn.Parameter(torch.randn(len(my_objs), 3, args.plane_ch, args.plane_res, args.plane_res,
                                      device=device) * 0.1)
    decoder = DDP(Decoder(args.plane_ch).to(device), device_ids=[local_rank])
    opt_dec = torch.optim.Adam(decoder.parameters(), lr=args.lr_decoder)
    opt_planes = torch.optim.Adam([planes], lr=args.lr_planes)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt_dec, T_max=args.epochs)

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        stat = torch.zeros(2, device=device)
        for rays, rgbs, obj in loader:
            rays = rays.to(device, non_blocking=True)
            rgbs = rgbs.to(device, non_blocking=True)
            obj = obj.to(device)
            pred = render(decoder, planes[obj], rays, args.samples)
            loss = F.mse_loss(pred, rgbs)
            loss = loss + args.tv_weight * tv_loss(planes[obj])
            opt_dec.zero_grad(set_to_none=True)
            opt_planes.zero_grad(set_to_none=True)
            loss.backward()
            opt_dec.step()
            opt_planes.step()
            stat += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stat)
        if rank == 0:
            print(f"epoch {epoch}: loss {(stat[0] / stat[1]).item():.5f} ({int(stat[1].item())} steps over all ranks)",
                  flush=True)
            torch.save(decoder.module.state_dict(), os.path.join(args.out, "decoder.pt"))
        # every rank writes only the triplanes it owns, one file per object
        for k, o in enumerate(my_objs):
            torch.save(planes[k].detach().half().cpu(), os.path.join(args.out, f"{o.replace('/', '_')}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
