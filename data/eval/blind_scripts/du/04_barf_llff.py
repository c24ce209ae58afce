"""BARF-style NeRF with joint camera refinement on LLFF forward-facing scenes.

Coarse-to-fine positional encoding: the high frequency bands are switched on
progressively between c2f_start and c2f_end (fraction of training).
Runs on all visible GPUs with nn.DataParallel; rays are split along the batch.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 04_barf_llff.py --scene /data/nerf_llff_data/fern
"""
import argparse
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.tensorboard import SummaryWriter
from tqdm import trange


def get_opts():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--out", default="logs/barf")
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--iters", type=int, default=200000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--n_samples", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr_end", type=float, default=1e-4)
    p.add_argument("--lr_pose", type=float, default=3e-3)
    p.add_argument("--lr_pose_end", type=float, default=1e-5)
    p.add_argument("--c2f_start", type=float, default=0.1)
    p.add_argument("--c2f_end", type=float, default=0.5)
    p.add_argument("--llffhold", type=int, default=8)
    p.add_argument("--i_val", type=int, default=5000)
    p.add_argument("--i_ckpt", type=int, default=10000)
    return p.parse_args()


def load_llff(basedir, factor):
    arr = np.load(os.path.join(basedir, "poses_bounds.npy"))
    poses = arr[:, :15].reshape(-1, 3, 5)
    bds = arr[:, 15:]
    imgdir = os.path.join(basedir, f"images_{factor}")
    files = sorted(f for f in os.listdir(imgdir) if f.lower().endswith(("png", "jpg")))
    imgs = np.stack([imageio.imread(os.path.join(imgdir, f))[..., :3] / 255.0 for f in files]).astype(np.float32)
    H, W = imgs.shape[1:3]
    focal = poses[0, 2, 4] / factor
    # LLFF [down, right, back] -> [right, up, back]
    poses = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:4]], 2)
    scale = 1.0 / (bds.min() * 0.75)
    poses[:, :3, 3] *= scale
    bds *= scale
    return imgs, poses[:, :3, :4].astype(np.float32), bds, H, W, focal


def se3_to_mat(w):
    """Exponential map from se3 (6-vector) to a 3x4 transform."""
    rot, trans = w[..., :3], w[..., 3:]
    theta = rot.norm(dim=-1, keepdim=True)[..., None] + 1e-8
    K = torch.zeros(*rot.shape[:-1], 3, 3, device=w.device)
    K[..., 0, 1], K[..., 0, 2], K[..., 1, 2] = -rot[..., 2], rot[..., 1], -rot[..., 0]
    K = K - K.transpose(-1, -2)
    I = torch.eye(3, device=w.device).expand_as(K)
    R = I + torch.sin(theta) / theta * K + (1 - torch.cos(theta)) / theta ** 2 * K @ K
    V = I + (1 - torch.cos(theta)) / theta ** 2 * K + (theta - torch.sin(theta)) / theta ** 3 * K @ K
    return torch.cat([R, (V @ trans[..., None])], -1)


class BARF(nn.Module):
    def __init__(self, n_images, total_iters, c2f=(0.1, 0.5), L=10, W=256):
        super().__init__()
        self.L, self.c2f, self.total_iters = L, c2f, total_iters
        self.step = 0
        self.pose_delta = nn.Embedding(n_images, 6)
        nn.init.zeros_(self.pose_delta.weight)
        d_in = 3 + 6 * L
        self.mlp = nn.ModuleList([nn.Linear(d_in, W)] + [nn.Linear(W + (d_in if i == 4 else 0), W) for i in range(7)])
        self.sigma = nn.Linear(W, 1)
        self.feat = nn.Linear(W, W)
        self.rgb = nn.Sequential(nn.Linear(W + 3 + 24, W // 2), nn.ReLU(True), nn.Linear(W // 2, 3))

    def encode(self, x, L, progress):
        freq = 2.0 ** torch.arange(L, device=x.device) * math.pi
        spec = x[..., None] * freq
        enc = torch.stack([torch.sin(spec), torch.cos(spec)], -2)  # [..., 3, 2, L]
        if progress is not None:
            start, end = self.c2f
            alpha = (progress - start) / (end - start) * L
            k = torch.arange(L, device=x.device, dtype=torch.float32)
            weight = (1 - (alpha - k).clamp(0, 1).mul(math.pi).cos()) / 2
            enc = enc * weight
        return torch.cat([x, enc.flatten(-3)], -1)

    def forward(self, rays_o, rays_d, img_idx, near, far, n_samples):
        if self.training:
            self.step += 1
        progress = self.step / self.total_iters
        # refine camera: apply the learned se3 correction to the ray
        T = se3_to_mat(self.pose_delta(img_idx))
        rays_d = (T[:, :3, :3] @ rays_d[..., None]).squeeze(-1)
        rays_o = (T[:, :3, :3] @ rays_o[..., None]).squeeze(-1) + T[:, :3, 3]

        t = torch.linspace(0, 1, n_samples, device=rays_o.device)
        z = 1.0 / (1.0 / near[:, None] * (1 - t) + 1.0 / far[:, None] * t)  # sample in disparity
        if self.training:
            z = z + (torch.rand_like(z) - 0.5) * (z[:, 1:2] - z[:, :1]).abs()
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        x = self.encode(pts, self.L, progress)
        h = x
        for i, lin in enumerate(self.mlp):
            if i == 5:
                h = torch.cat([h, x], -1)
            h = F.relu(lin(h))
        sigma = F.softplus(self.sigma(h).squeeze(-1))
        d = F.normalize(rays_d, dim=-1)[:, None].expand_as(pts)
        rgb = torch.sigmoid(self.rgb(torch.cat([self.feat(h), self.encode(d, 4, None)], -1)))
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * rays_d.norm(dim=-1, keepdim=True)
        alpha = 1 - torch.exp(-sigma * delta)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        w = alpha * trans
        return (w[..., None] * rgb).sum(1), (w * z).sum(1)


def main():
    opt = get_opts()
    os.makedirs(opt.out, exist_ok=True)
    imgs, poses, bds, H, W, focal = load_llff(opt.scene, opt.factor)
    n = imgs.shape[0]
    i_test = np.arange(n)[:: opt.llffhold]
    i_train = np.array([i for i in range(n) if i not in i_test])

    # all training rays, precomputed once
    xs, ys = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing="xy")
    dirs = np.stack([(xs - W * 0.5) / focal, -(ys - H * 0.5) / focal, -np.ones_like(xs)], -1)
    rays_d = np.einsum("hwj,nij->nhwi", dirs, poses[i_train, :3, :3]).reshape(-1, 3)
    rays_o = np.broadcast_to(poses[i_train, None, None, :3, 3], (len(i_train), H, W, 3)).reshape(-1, 3)
    rgbs = imgs[i_train].reshape(-1, 3)
    idx = np.repeat(np.arange(len(i_train)), H * W)
    near = np.repeat(bds[i_train, 0] * 0.9, H * W)
    far = np.repeat(bds[i_train, 1] * 1.0, H * W)
    data = [torch.from_numpy(np.ascontiguousarray(a)) for a in (rays_o, rays_d, rgbs, idx, near, far)]
    print(f"{len(i_train)} train / {len(i_test)} test views, {data[0].shape[0]} rays, {torch.cuda.device_count()} GPUs")

    model = BARF(len(i_train), opt.iters, c2f=(opt.c2f_start, opt.c2f_end)).cuda()
    model = nn.DataParallel(model)
    nerf_params = [p for n_, p in model.module.named_parameters() if not n_.startswith("pose_delta")]
    optim = torch.optim.Adam([{"params": nerf_params, "lr": opt.lr},
                              {"params": model.module.pose_delta.parameters(), "lr": opt.lr_pose}])
    g_nerf = (opt.lr_end / opt.lr) ** (1.0 / opt.iters)
    g_pose = (opt.lr_pose_end / opt.lr_pose) ** (1.0 / opt.iters)
    writer = SummaryWriter(opt.out)

    perm = torch.randperm(data[0].shape[0])
    ptr = 0
    for it in trange(1, opt.iters + 1):
        if ptr + opt.batch > perm.numel():
            perm, ptr = torch.randperm(data[0].shape[0]), 0
        sel = perm[ptr:ptr + opt.batch]
        ptr += opt.batch
        ro, rd, gt, ii, nr, fr = (t[sel].cuda(non_blocking=True) for t in data)

        rgb, depth = model(ro, rd, ii, nr, fr, opt.n_samples)
        loss = F.mse_loss(rgb, gt)
        optim.zero_grad()
        loss.backward()
        optim.step()
        optim.param_groups[0]["lr"] *= g_nerf
        optim.param_groups[1]["lr"] *= g_pose

        if it % 100 == 0:
            writer.add_scalar("train/loss", loss.item(), it)
            writer.add_scalar("train/psnr", -10 * math.log10(loss.item()), it)
            writer.add_scalar("train/c2f_progress", model.module.step / opt.iters, it)
            dw = model.module.pose_delta.weight.detach()
            writer.add_scalar("pose/rot_norm", dw[:, :3].norm(dim=-1).mean().item(), it)
            writer.add_scalar("pose/trans_norm", dw[:, 3:].norm(dim=-1).mean().item(), it)

        if it % opt.i_val == 0:
            model.eval()
            with torch.no_grad():
                v = i_test[0]
                d = np.einsum("hwj,ij->hwi", dirs, poses[v, :3, :3]).reshape(-1, 3)
                o = np.broadcast_to(poses[v, :3, 3], d.shape)
                d, o = torch.from_numpy(d).cuda(), torch.from_numpy(np.ascontiguousarray(o)).cuda()
                zero = torch.zeros(d.shape[0], dtype=torch.long, device=d.device)
                nr = torch.full((d.shape[0],), float(bds[v, 0] * 0.9), device=d.device)
                fr = torch.full((d.shape[0],), float(bds[v, 1]), device=d.device)
                out = torch.cat([model(o[s:s + 8192], d[s:s + 8192], zero[s:s + 8192], nr[s:s + 8192],
                                       fr[s:s + 8192], opt.n_samples)[0] for s in range(0, d.shape[0], 8192)])
                img = out.reshape(H, W, 3).clamp(0, 1)
                psnr = -10 * torch.log10(F.mse_loss(img, torch.from_numpy(imgs[v]).cuda())).item()
            writer.add_scalar("val/psnr_unaligned", psnr, it)
            writer.add_image("val/rgb", img.permute(2, 0, 1), it)
            model.train()

        if it % opt.i_ckpt == 0:
            torch.save({"it": it, "model": model.module.state_dict(), "optim": optim.state_dict(),
                        "c2f_step": model.module.step}, os.path.join(opt.out, f"{it:06d}.tar"))
    writer.close()


if __name__ == "__main__":
    main()
