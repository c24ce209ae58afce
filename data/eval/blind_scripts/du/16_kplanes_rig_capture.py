"""Static K-Planes on captures from the lab's camera rig (nerfstudio format).

The rig captures have no official split, so a fixed fraction of the frames is
held out for validation. Rays are sampled independently on every GPU.

    torchrun --nproc_per_node=4 16_kplanes_rig_capture.py --data /mnt/rig/2024_03_11_statue --out runs/statue
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class KPlanes(nn.Module):
    def __init__(self, resolutions=(64, 128, 256, 512), feat_dim=32, bound=2.0):
        super().__init__()
        self.bound = bound
        self.combos = [(0, 1), (0, 2), (1, 2)]
        self.planes = nn.ModuleList()
        for r in resolutions:
            ps = nn.ParameterList([nn.Parameter(torch.empty(1, feat_dim, r, r).uniform_(0.1, 0.5)) for _ in self.combos])
            self.planes.append(ps)
        d = feat_dim * len(resolutions)
        self.sigma_net = nn.Sequential(nn.Linear(d, 64), nn.ReLU(True), nn.Linear(64, 16))
        self.color_net = nn.Sequential(nn.Linear(15 + 16, 64), nn.ReLU(True), nn.Linear(64, 64), nn.ReLU(True),
                                       nn.Linear(64, 3), nn.Sigmoid())

    def features(self, x):
        x = x / self.bound
        feats = []
        for ps in self.planes:
            f = 1.0
            for p, (a, b) in zip(ps, self.combos):
                coords = x[:, [a, b]].view(1, -1, 1, 2)
                f = f * F.grid_sample(p, coords, align_corners=True).view(p.shape[1], -1).T
            feats.append(f)
        return torch.cat(feats, -1)

    @staticmethod
    def sh_deg3(d):
        x, y, z = d.unbind(-1)
        return torch.stack([x, y, z, x * y, x * z, y * z, x * x - y * y, 3 * z * z - 1,
                            x * (x * x - 3 * y * y), y * (3 * x * x - y * y), z * (x * x - y * y),
                            x * y * z, x * (5 * z * z - 1), y * (5 * z * z - 1), z * (5 * z * z - 3)], -1)

    def forward(self, o, d, near, far, n_samples, perturb=True):
        t = torch.linspace(0, 1, n_samples, device=o.device)
        z = near + (far - near) * t
        z = z.expand(o.shape[0], -1)
        if perturb:
            z = z + torch.rand_like(z) * (far - near) / n_samples
        pts = (o[:, None] + d[:, None] * z[..., None]).reshape(-1, 3)
        inside = (pts.abs() < self.bound).all(-1, keepdim=True).float()
        h = self.sigma_net(self.features(pts.clamp(-self.bound, self.bound)))
        sigma = (torch.exp(h[:, 0] - 1.0) * inside[:, 0]).view(z.shape)
        dn = F.normalize(d, dim=-1)[:, None].expand(-1, n_samples, -1).reshape(-1, 3)
        rgb = self.color_net(torch.cat([self.sh_deg3(dn), h], -1)).view(*z.shape, 3)
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), w

    def plane_tv(self):
        tv = 0.0
        for ps in self.planes:
            for p in ps:
                tv = tv + (p[..., 1:, :] - p[..., :-1, :]).pow(2).mean() + (p[..., 1:] - p[..., :-1]).pow(2).mean()
        return tv


def load_capture(root, downscale):
    with open(os.path.join(root, "transforms.json")) as f:
        meta = json.load(f)
    frames = sorted(meta["frames"], key=lambda fr: fr["file_path"])
    imgs, c2w = [], []
    for fr in frames:
        im = imageio.imread(os.path.join(root, fr["file_path"]))[::downscale, ::downscale, :3]
        imgs.append(im)
        c2w.append(np.array(fr["transform_matrix"], dtype=np.float32))
    K = np.array([meta["fl_x"], meta["fl_y"], meta["cx"], meta["cy"]], dtype=np.float32) / downscale
    return torch.from_numpy(np.stack(imgs)), torch.from_numpy(np.stack(c2w)), torch.from_numpy(K)


def rays_from_pixels(c2w, K, x, y):
    d = torch.stack([(x + 0.5 - K[2]) / K[0], -(y + 0.5 - K[3]) / K[1], -torch.ones_like(x)], -1)
    return c2w[..., :3, 3].expand_as(d), (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--downscale", type=int, default=2)
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--iters", type=int, default=30000)
    ap.add_argument("--rays", type=int, default=8192, help="global")
    ap.add_argument("--n_samples", type=int, default=256)
    ap.add_argument("--near", type=float, default=0.2)
    ap.add_argument("--far", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--tv", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    seed_everything(args.seed + rank)

    imgs, c2w, K = load_capture(args.data, args.downscale)
    n = imgs.shape[0]
    perm = np.random.permutation(n)
    n_val = max(1, int(round(args.val_frac * n)))
    val_ids, train_ids = np.sort(perm[:n_val]), np.sort(perm[n_val:])
    if rank == 0:
        print(f"{n} frames: {len(train_ids)} train / {len(val_ids)} val; H,W = {tuple(imgs.shape[1:3])}")
    tr_imgs = imgs[train_ids].to(dev)
    tr_c2w = c2w[train_ids].to(dev)
    K = K.to(dev)
    H, W = imgs.shape[1:3]

    model = DDP(KPlanes().to(dev), device_ids=[local_rank])
    grid_params = [p for n_, p in model.module.named_parameters() if n_.startswith("planes")]
    mlp_params = [p for n_, p in model.module.named_parameters() if not n_.startswith("planes")]
    optim = torch.optim.Adam([{"params": grid_params}, {"params": mlp_params}], lr=args.lr, eps=1e-15)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=args.lr, total_steps=args.iters, pct_start=0.02)
    writer = SummaryWriter(args.out) if rank == 0 else None
    m = args.rays // world

    for it in range(1, args.iters + 1):
        v = torch.randint(0, len(train_ids), (m,), device=dev)
        x = torch.randint(0, W, (m,), device=dev)
        y = torch.randint(0, H, (m,), device=dev)
        o, d = rays_from_pixels(tr_c2w[v], K, x.float(), y.float())
        rgb, _ = model(o, d, args.near, args.far, args.n_samples)
        mse = F.mse_loss(rgb, tr_imgs[v, y, x].float() / 255.0)
        loss = mse + args.tv * model.module.plane_tv()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if it % 200 == 0:
            s = mse.detach().clone()
            dist.all_reduce(s, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/psnr", -10 * math.log10(s.item()), it)

        if it % 5000 == 0 or it == args.iters:
            net = model.module
            tot = torch.zeros(2, device=dev)
            ys, xs = torch.meshgrid(torch.arange(H, device=dev).float(), torch.arange(W, device=dev).float(), indexing="ij")
            with torch.no_grad():
                for vi in val_ids[rank::world]:
                    o, d = rays_from_pixels(c2w[vi].to(dev), K, xs.reshape(-1), ys.reshape(-1))
                    pred = torch.cat([net(o[s:s + 8192], d[s:s + 8192], args.near, args.far, args.n_samples, perturb=False)[0]
                                      for s in range(0, o.shape[0], 8192)])
                    gt = imgs[vi].to(dev).reshape(-1, 3).float() / 255.0
                    tot[0] += -10 * torch.log10(F.mse_loss(pred, gt))
                    tot[1] += 1
            dist.all_reduce(tot)
            if rank == 0:
                writer.add_scalar("val/psnr", (tot[0] / tot[1].clamp_min(1)).item(), it)
                torch.save({"it": it, "model": net.state_dict(), "val_ids": val_ids.tolist()},
                           os.path.join(args.out, "kplanes.pt"))
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
