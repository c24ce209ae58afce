"""NeRF on DTU scans (IDR/NeuS camera format), few held-out views, multi-GPU.

Each step every GPU picks one training view and samples a patch-free batch of rays from it.

    torchrun --nproc_per_node=4 15_nerf_dtu.py --scan_dir data/DTU/scan65 --out exp/dtu65
"""
import argparse
import glob
import os
import random

import cv2
import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--scan_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n_test", type=int, default=6)
    p.add_argument("--iters", type=int, default=100_000)
    p.add_argument("--rays", type=int, default=4096, help="rays per step over all GPUs")
    p.add_argument("--n_samples", type=int, default=96)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval_every", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def load_K_Rt_from_P(P):
    out = cv2.decomposeProjectionMatrix(P)
    K, R, t = out[0], out[1], out[2]
    K = K / K[2, 2]
    intrinsics = np.eye(4, dtype=np.float32)
    intrinsics[:3, :3] = K
    pose = np.eye(4, dtype=np.float32)
    pose[:3, :3] = R.transpose()
    pose[:3, 3] = (t[:3] / t[3])[:, 0]
    return intrinsics, pose


def load_dtu(scan_dir):
    cams = np.load(os.path.join(scan_dir, "cameras_sphere.npz"))
    files = sorted(glob.glob(os.path.join(scan_dir, "image", "*.png")))
    masks = sorted(glob.glob(os.path.join(scan_dir, "mask", "*.png")))
    imgs, Ks, c2ws, ms = [], [], [], []
    for i, f in enumerate(files):
        P = (cams[f"world_mat_{i}"] @ cams[f"scale_mat_{i}"])[:3, :4]
        K, c2w = load_K_Rt_from_P(P)
        imgs.append(cv2.cvtColor(cv2.imread(f), cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0)
        ms.append((cv2.imread(masks[i], cv2.IMREAD_GRAYSCALE) > 127).astype(np.float32))
        Ks.append(K[:3, :3])
        c2ws.append(c2w)
    return (torch.from_numpy(np.stack(imgs)), torch.from_numpy(np.stack(ms)),
            torch.from_numpy(np.stack(Ks)), torch.from_numpy(np.stack(c2ws)))


def rays_from(K, c2w, xs, ys):
    d = torch.stack([(xs - K[0, 2]) / K[0, 0], (ys - K[1, 2]) / K[1, 1], torch.ones_like(xs)], -1)
    d = d @ c2w[:3, :3].T
    d = F.normalize(d, dim=-1)
    return c2w[:3, 3].expand_as(d), d


def near_far_sphere(o, d):
    # scene is normalised into the unit sphere by scale_mat
    b = (o * d).sum(-1, keepdim=True)
    mid = -b
    return (mid - 1.0).clamp_min(0.05), mid + 1.0


class PE(nn.Module):
    def __init__(self, L):
        super().__init__()
        self.L = L

    def forward(self, x):
        return torch.cat([x] + [f(x * (2.0 ** k)) for k in range(self.L) for f in (torch.sin, torch.cos)], -1)


class RadianceField(nn.Module):
    def __init__(self, W=256):
        super().__init__()
        self.pe_x, self.pe_d = PE(10), PE(4)
        self.net = nn.Sequential(nn.Linear(63, W), nn.Softplus(beta=100), *[m for _ in range(6) for m in (nn.Linear(W, W), nn.Softplus(beta=100))])
        self.sigma = nn.Linear(W, 1)
        self.color = nn.Sequential(nn.Linear(W + 27, W // 2), nn.ReLU(), nn.Linear(W // 2, 3))

    def forward(self, o, d, near, far, n, perturb):
        t = torch.linspace(0, 1, n, device=o.device)
        z = near + (far - near) * t
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (far - near) / n
        x = o[:, None] + d[:, None] * z[..., None]
        h = self.net(self.pe_x(x))
        sigma = F.softplus(self.sigma(h).squeeze(-1))
        rgb = torch.sigmoid(self.color(torch.cat([h, self.pe_d(d)[:, None].expand(-1, n, -1)], -1)))
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e3)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-7], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1), w.sum(-1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different ray samples on each GPU
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    imgs, masks, Ks, c2ws = load_dtu(args.scan_dir)
    n_views = imgs.shape[0]
    test_views = sorted(random.sample(range(n_views), args.n_test))
    train_views = [i for i in range(n_views) if i not in test_views]
    H, W = imgs.shape[1:3]
    imgs, masks, Ks, c2ws = imgs.to(device), masks.to(device), Ks.to(device), c2ws.to(device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"DTU {os.path.basename(args.scan_dir)}: {len(train_views)} train / {len(test_views)} test views "
              f"{test_views}, {H}x{W}", flush=True)

    model = DDP(RadianceField().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    warmup = 2000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + np.cos(np.pi * min(s, args.iters) / args.iters)) * 0.95 + 0.05))
    lp = lpips.LPIPS(net="vgg").to(device)

    for it in range(1, args.iters + 1):
        v = train_views[np.random.randint(len(train_views))]
        xs = torch.randint(0, W, (args.rays // world,), device=device)
        ys = torch.randint(0, H, (args.rays // world,), device=device)
        o, d = rays_from(Ks[v], c2ws[v], xs.float() + 0.5, ys.float() + 0.5)
        near, far = near_far_sphere(o, d)
        rgb, acc = model(o, d, near, far, args.n_samples, perturb=True)
        gt, m = imgs[v, ys, xs], masks[v, ys, xs]
        loss = F.l1_loss(rgb, gt) + 0.1 * F.binary_cross_entropy(acc.clamp(1e-4, 1 - 1e-4), m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

        if it % 200 == 0:
            logv = torch.stack([loss.detach(), F.mse_loss(rgb.detach(), gt)])
            dist.all_reduce(logv, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"it {it} loss {logv[0]:.4f} psnr {-10 * torch.log10(logv[1]):.2f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        if it % args.eval_every == 0:
            net = model.module
            acc_m = torch.zeros(3, device=device)
            with torch.no_grad():
                for v in test_views[rank::world]:
                    yy, xx = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
                    o, d = rays_from(Ks[v], c2ws[v], xx.flatten().float() + 0.5, yy.flatten().float() + 0.5)
                    nr, fr = near_far_sphere(o, d)
                    pred = torch.cat([net(o[s:s + 4096], d[s:s + 4096], nr[s:s + 4096], fr[s:s + 4096], args.n_samples, False)[0]
                                      for s in range(0, o.shape[0], 4096)]).view(H, W, 3)
                    m = masks[v][..., None]
                    gt = imgs[v]
                    mse = ((pred - gt) ** 2 * m).sum() / (m.sum() * 3)
                    acc_m[0] += -10 * torch.log10(mse)
                    acc_m[1] += lp(pred.permute(2, 0, 1)[None] * m.permute(2, 0, 1)[None],
                                   gt.permute(2, 0, 1)[None] * m.permute(2, 0, 1)[None], normalize=True).squeeze()
                    acc_m[2] += 1
                    cv2.imwrite(os.path.join(args.out, f"it{it:06d}_view{v:02d}.png"),
                                cv2.cvtColor((pred.clamp(0, 1).cpu().numpy() * 255).astype(np.uint8), cv2.COLOR_RGB2BGR))
            dist.all_reduce(acc_m)
            if rank == 0:
                print(f"[eval it {it}] masked PSNR {acc_m[0] / acc_m[2]:.2f}  LPIPS {acc_m[1] / acc_m[2]:.4f}", flush=True)
                torch.save({"it": it, "model": net.state_dict(), "opt": opt.state_dict()}, os.path.join(args.out, "model.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
