#!/usr/bin/env python3
"""Plain NeRF MLP trainer for the NeRF-synthetic scenes (single network, 192 stratified samples).

Multi-GPU:  torchrun --nproc_per_node=4 17_nerf_mlp_torchrun.py --scene data/nerf_synthetic/ficus --logdir logs/ficus
"""
import argparse
import json
import math
import os
import time

import imageio.v2 as imageio
import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--logdir", required=True)
    p.add_argument("--epochs", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=8192, help="global, split over GPUs")
    p.add_argument("--samples", type=int, default=192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--val_views", type=int, default=16)
    return p.parse_args()


def read_split(scene, split):
    meta = json.load(open(os.path.join(scene, f"transforms_{split}.json")))
    rgbs, poses = [], []
    for fr in meta["frames"]:
        im = imageio.imread(os.path.join(scene, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        rgbs.append(im[..., :3] * im[..., 3:] + (1.0 - im[..., 3:]))
        poses.append(np.asarray(fr["transform_matrix"], np.float32))
    rgbs = torch.from_numpy(np.stack(rgbs))
    H, W = rgbs.shape[1:3]
    focal = 0.5 * W / math.tan(0.5 * meta["camera_angle_x"])
    return rgbs, torch.from_numpy(np.stack(poses)), H, W, focal


def image_rays(H, W, focal, c2w):
    u, v = torch.meshgrid(torch.arange(W) + 0.5, torch.arange(H) + 0.5, indexing="xy")
    dirs = torch.stack([(u - W / 2) / focal, -(v - H / 2) / focal, -torch.ones_like(u)], -1)
    d = dirs @ c2w[:3, :3].T
    return torch.cat([c2w[:3, 3].expand_as(d), d], -1)


class FourierFeatures(nn.Module):
    def __init__(self, n_freq, include_input=True):
        super().__init__()
        self.n_freq, self.include_input = n_freq, include_input

    def out_dim(self, d):
        return d * (2 * self.n_freq + int(self.include_input))

    def forward(self, x):
        feats = [x] if self.include_input else []
        for k in range(self.n_freq):
            feats += [torch.sin((2.0 ** k) * math.pi * x), torch.cos((2.0 ** k) * math.pi * x)]
        return torch.cat(feats, -1)


class NeRFMLP(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.fx, self.fd = FourierFeatures(10), FourierFeatures(4)
        dx, dd = self.fx.out_dim(3), self.fd.out_dim(3)
        self.stage1 = nn.Sequential(nn.Linear(dx, width), nn.ReLU(True), nn.Linear(width, width), nn.ReLU(True),
                                    nn.Linear(width, width), nn.ReLU(True), nn.Linear(width, width), nn.ReLU(True))
        self.stage2 = nn.Sequential(nn.Linear(width + dx, width), nn.ReLU(True), nn.Linear(width, width), nn.ReLU(True),
                                    nn.Linear(width, width), nn.ReLU(True), nn.Linear(width, width + 1))
        self.rgb = nn.Sequential(nn.Linear(width + dd, width // 2), nn.ReLU(True), nn.Linear(width // 2, 3), nn.Sigmoid())

    def forward(self, x, d):
        ex = self.fx(x / 1.5)
        h = self.stage2(torch.cat([self.stage1(ex), ex], -1))
        return self.rgb(torch.cat([h[..., 1:], self.fd(d)], -1)), F.softplus(h[..., 0] - 1.0)


def render(net, rays, samples, near=2.0, far=6.0, stratified=True):
    o, d = rays[:, :3], rays[:, 3:6]
    t = torch.linspace(near, far, samples + 1, device=rays.device)
    lo, hi = t[:-1], t[1:]
    z = lo + (hi - lo) * (torch.rand(rays.shape[0], samples, device=rays.device) if stratified else 0.5)
    pts = o[:, None] + d[:, None] * z[..., None]
    dn = F.normalize(d, dim=-1)[:, None].expand_as(pts)
    rgb, sigma = net(pts, dn)
    delta = (hi - lo)[None] * d.norm(dim=-1, keepdim=True)
    tau = sigma * delta
    alpha = 1 - torch.exp(-tau)
    T = torch.exp(-torch.cumsum(F.pad(tau[:, :-1], (1, 0)), -1))
    w = alpha * T
    return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    rgbs, poses, H, W, focal = read_split(args.scene, "train")
    rays = torch.cat([image_rays(H, W, focal, p).reshape(-1, 6) for p in poses])
    ds = TensorDataset(rays, rgbs.reshape(-1, 3))
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.batch_size // world, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_rgbs, val_poses, _, _, _ = read_split(args.scene, "val")
    val_ids = np.linspace(0, len(val_rgbs) - 1, args.val_views).astype(int).tolist()

    model = DDP(NeRFMLP().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.02,
                                                div_factor=100, final_div_factor=100)
    lp = lpips.LPIPS(net="alex").to(device)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for r, c in dl:
            r, c = r.to(device, non_blocking=True), c.to(device, non_blocking=True)
            pred = render(model, r, args.samples)
            loss = F.mse_loss(pred, c)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer:
                    writer.add_scalar("train/mse", l.item(), step)
                    writer.add_scalar("train/psnr", -10 * math.log10(l.item()), step)

        # validation: every rank renders a share of the views, then the sums are combined
        model.eval()
        psnrs, lpipss = [], []
        net = model.module
        with torch.no_grad():
            for i in val_ids[rank::world]:
                vr = image_rays(H, W, focal, val_poses[i]).reshape(-1, 6).to(device)
                img = torch.cat([render(net, vr[s:s + 8192], args.samples, stratified=False)
                                 for s in range(0, vr.shape[0], 8192)]).view(H, W, 3).clamp(0, 1)
                gt = val_rgbs[i].to(device)
                psnrs.append(-10.0 * math.log10(F.mse_loss(img, gt).item()))
                lpipss.append(lp(img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], normalize=True).item())
                if rank == 0 and i == val_ids[0]:
                    imageio.imwrite(os.path.join(args.logdir, f"val_{epoch:03d}.png"), (img.cpu().numpy() * 255).astype(np.uint8))
        stats = torch.tensor([sum(psnrs), sum(lpipss), len(psnrs)], dtype=torch.float64)
        dist.all_reduce(stats)
        if rank == 0:
            n = stats[2].item()
            writer.add_scalar("val/psnr", stats[0].item() / n, epoch)
            writer.add_scalar("val/lpips", stats[1].item() / n, epoch)
            print(f"epoch {epoch} | {time.time() - t0:.0f}s | val PSNR {stats[0].item() / n:.2f} "
                  f"LPIPS {stats[1].item() / n:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(args.logdir, "last.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
