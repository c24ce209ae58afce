"""Unbounded-scene NeRF (mip-NeRF 360 scene contraction, proposal + NeRF MLPs).

Trained on two 8-GPU nodes. After training every rank renders its share of the
test views; per-view PSNR / SSIM are gathered so rank 0 can write a per-view
table next to the averages.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        15_unbounded_nerf_multinode.py --scene /shared/data/360_v2/bicycle --out /shared/runs/bicycle
"""
import argparse
import csv
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--steps", type=int, default=250000)
    p.add_argument("--rays", type=int, default=16384, help="global rays per step")
    p.add_argument("--lr_init", type=float, default=2e-3)
    p.add_argument("--lr_final", type=float, default=2e-5)
    p.add_argument("--warmup", type=int, default=512)
    p.add_argument("--n_prop", type=int, default=64)
    p.add_argument("--n_nerf", type=int, default=32)
    return p.parse_args()


def contract(x):
    n = x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return torch.where(n <= 1, x, (2 - 1 / n) * x / n)


def pe(x, lo, hi):
    f = 2.0 ** torch.arange(lo, hi, device=x.device)
    xf = (x[..., None] * f).flatten(-2)
    return torch.cat([x, xf.sin(), xf.cos()], -1)


class MLP(nn.Module):
    def __init__(self, depth, width, color):
        super().__init__()
        self.color = color
        dims = [3 + 6 * 12] + [width] * depth
        self.net = nn.Sequential(*sum([[nn.Linear(a, b), nn.ReLU(True)] for a, b in zip(dims[:-1], dims[1:])], []))
        self.sigma = nn.Linear(width, 1)
        if color:
            self.rgb = nn.Sequential(nn.Linear(width + 3 + 6 * 4, width // 2), nn.ReLU(True), nn.Linear(width // 2, 3))

    def forward(self, pts, dirs):
        h = self.net(pe(contract(pts) / 2, 0, 12))
        sigma = F.softplus(self.sigma(h).squeeze(-1) - 1)
        if not self.color:
            return sigma
        return sigma, torch.sigmoid(self.rgb(torch.cat([h, pe(dirs, 0, 4)], -1)))


def s_to_t(s, near, far):
    # uniform in disparity beyond 1, as in mip-NeRF 360
    g = lambda x: 1 / x
    return g(s * g(far) + (1 - s) * g(near))


def weights_from(sigma, t):
    delta = t[..., 1:] - t[..., :-1]
    alpha = 1 - torch.exp(-sigma * delta)
    return alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1 - alpha + 1e-10], -1), -1)[..., :-1]


def resample(s, w, n, det):
    pdf = (w + 1e-5) / (w + 1e-5).sum(-1, keepdim=True)
    cdf = torch.cat([torch.zeros_like(pdf[..., :1]), pdf.cumsum(-1).clamp_max(1)], -1)
    u = torch.linspace(0, 1, n + 1, device=s.device)[:-1] + 0.5 / n if det else torch.rand(*s.shape[:-1], n, device=s.device)
    u = u.expand(*s.shape[:-1], n).contiguous()
    i = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[-1] - 1)
    c0, c1, s0, s1 = cdf.gather(-1, i - 1), cdf.gather(-1, i), s.gather(-1, i - 1), s.gather(-1, i)
    mid = s0 + (u - c0) / (c1 - c0).clamp_min(1e-6) * (s1 - s0)
    return torch.sort(torch.cat([s[..., :1], mid, s[..., -1:]], -1), -1)[0]


class Model(nn.Module):
    def __init__(self, n_prop, n_nerf):
        super().__init__()
        self.prop = MLP(4, 256, color=False)
        self.nerf = MLP(8, 512, color=True)
        self.n_prop, self.n_nerf = n_prop, n_nerf

    def forward(self, o, d, near=0.2, far=1e3, det=False):
        s = torch.linspace(0, 1, self.n_prop + 1, device=o.device).expand(o.shape[0], -1)
        t = s_to_t(s, near, far)
        mid = 0.5 * (t[:, 1:] + t[:, :-1])
        dn = F.normalize(d, dim=-1)
        sig_p = self.prop(o[:, None] + d[:, None] * mid[..., None], None)
        w_p = weights_from(sig_p, t)
        s_f = resample(s, w_p.detach(), self.n_nerf, det)
        t_f = s_to_t(s_f, near, far)
        mid_f = 0.5 * (t_f[:, 1:] + t_f[:, :-1])
        sig, rgb = self.nerf(o[:, None] + d[:, None] * mid_f[..., None], dn[:, None].expand(-1, mid_f.shape[1], -1))
        w = weights_from(sig, t_f)
        color = (w[..., None] * rgb).sum(1)
        # proposal loss: proposal weights should bound the nerf weights (histogram outer measure)
        cw = torch.cat([torch.zeros_like(w[:, :1]), w.detach().cumsum(-1)], -1)
        idx_lo = torch.searchsorted(s_f.contiguous(), s[:, :-1].contiguous(), right=True).clamp(1, w.shape[1]) - 1
        idx_hi = torch.searchsorted(s_f.contiguous(), s[:, 1:].contiguous(), right=False).clamp(0, w.shape[1])
        bound = cw.gather(1, idx_hi) - cw.gather(1, idx_lo)
        prop_loss = (F.relu(bound - w_p) ** 2 / (w_p + 1e-5)).sum(-1).mean()
        return color, prop_loss


def load(scene, factor):
    pb = np.load(os.path.join(scene, "poses_bounds.npy"))
    poses = pb[:, :15].reshape(-1, 3, 5)
    poses = np.concatenate([poses[:, :, 1:2], -poses[:, :, 0:1], poses[:, :, 2:]], 2)
    centre = poses[:, :3, 3].mean(0)
    poses[:, :3, 3] -= centre
    scale = 1.0 / np.abs(poses[:, :3, 3]).max()
    poses[:, :3, 3] *= scale
    d = os.path.join(scene, f"images_{factor}")
    imgs = np.stack([imageio.imread(os.path.join(d, f)) for f in sorted(os.listdir(d))]).astype(np.float32) / 255.0
    focal = poses[0, 2, 4] / factor
    return torch.from_numpy(imgs[..., :3]), torch.from_numpy(poses[:, :3, :4].astype(np.float32)), float(focal)


def camera_rays(c2w, focal, H, W, x, y):
    d = torch.stack([(x + 0.5 - W / 2) / focal, -(y + 0.5 - H / 2) / focal, -torch.ones_like(x)], -1)
    return c2w[..., :3, 3].expand_as(d), (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    imgs, poses, focal = load(args.scene, args.factor)
    N, H, W = imgs.shape[:3]
    test_ids = list(range(0, N, 8))
    train_ids = torch.tensor([i for i in range(N) if i % 8])
    imgs_tr, poses_tr = imgs[train_ids].to(dev), poses[train_ids].to(dev)

    model = DDP(Model(args.n_prop, args.n_nerf).to(dev), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr_init, eps=1e-6)

    def lr_at(step):
        w = min(1.0, step / args.warmup)
        p = step / args.steps
        return w * math.exp((1 - p) * math.log(args.lr_init) + p * math.log(args.lr_final)) / args.lr_init

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    per_rank = args.rays // world
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for step in range(1, args.steps + 1):
        v = torch.randint(0, len(train_ids), (per_rank,), device=dev)
        x = torch.randint(0, W, (per_rank,), device=dev)
        y = torch.randint(0, H, (per_rank,), device=dev)
        o, d = camera_rays(poses_tr[v], focal, H, W, x.float(), y.float())
        color, prop_loss = model(o, d)
        loss = F.mse_loss(color, imgs_tr[v, y, x]) + prop_loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optim.step()
        sched.step()
        if step % 1000 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.5f}", flush=True)
        if step % 25000 == 0 and rank == 0:
            torch.save({"step": step, "model": model.module.state_dict()}, os.path.join(args.out, "model.pt"))

    # ---- evaluation ----
    net = model.module.eval()
    mine = test_ids[rank::world]
    local = torch.zeros(len(mine), 3, device=dev)  # view id, psnr, ssim
    ys, xs = torch.meshgrid(torch.arange(H, device=dev).float(), torch.arange(W, device=dev).float(), indexing="ij")
    with torch.no_grad():
        for k, i in enumerate(mine):
            o, d = camera_rays(poses[i].to(dev), focal, H, W, xs.reshape(-1), ys.reshape(-1))
            img = torch.cat([net(o[s:s + 4096], d[s:s + 4096], det=True)[0] for s in range(0, o.shape[0], 4096)])
            img = img.reshape(H, W, 3).clamp(0, 1)
            gt = imgs[i].to(dev)
            local[k, 0] = i
            local[k, 1] = -10 * torch.log10(F.mse_loss(img, gt))
            local[k, 2] = ssim_fn(img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0)
            imageio.imwrite(os.path.join(args.out, f"test_{i:03d}.png"), (img.cpu().numpy() * 255).astype(np.uint8))
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    if rank == 0:
        table = torch.cat(gathered).cpu().numpy()
        table = table[np.argsort(table[:, 0])]
        with open(os.path.join(args.out, "test_metrics.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["view", "psnr", "ssim"])
            for row in table:
                w.writerow([int(row[0]), f"{row[1]:.3f}", f"{row[2]:.4f}"])
            w.writerow(["mean", f"{table[:, 1].mean():.3f}", f"{table[:, 2].mean():.4f}"])
        print(f"PSNR {table[:, 1].mean():.2f}  SSIM {table[:, 2].mean():.4f}  ({len(table)} views)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
