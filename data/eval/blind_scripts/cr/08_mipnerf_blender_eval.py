"""mip-NeRF (integrated positional encoding over conical frustums), DDP training + test-set evaluation.

    torchrun --nproc_per_node=8 train_mipnerf.py --scene data/nerf_synthetic/chair --out exp/mip_chair
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max_steps", type=int, default=250000)
    p.add_argument("--batch_size", type=int, default=4096, help="global ray batch")
    p.add_argument("--lr_init", type=float, default=5e-4)
    p.add_argument("--lr_final", type=float, default=5e-6)
    p.add_argument("--warmup", type=int, default=2500)
    p.add_argument("--num_samples", type=int, default=128)
    p.add_argument("--ckpt_every", type=int, default=25000)
    p.add_argument("--log_every", type=int, default=500)
    p.add_argument("--eval_only", action="store_true")
    return p


def load_blender(scene, split):
    meta = json.load(open(os.path.join(scene, f"transforms_{split}.json")))
    ims = np.stack([imageio.imread(os.path.join(scene, fr["file_path"] + ".png")) for fr in meta["frames"]])
    ims = ims.astype(np.float32) / 255.0
    ims = ims[..., :3] * ims[..., 3:] + (1.0 - ims[..., 3:])
    poses = np.stack([np.asarray(fr["transform_matrix"], np.float32) for fr in meta["frames"]])
    focal = 0.5 * ims.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return torch.from_numpy(ims), torch.from_numpy(poses), float(focal)


def camera_rays(c2w, ys, xs, H, W, focal):
    d = torch.stack([(xs + 0.5 - W / 2) / focal, -(ys + 0.5 - H / 2) / focal, -torch.ones_like(xs)], -1)
    rd = (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)
    ro = c2w[..., :3, 3].expand_as(rd)
    radii = torch.full_like(xs, 2.0 / math.sqrt(12) / focal)  # pixel footprint
    return ro, rd, radii


class TestViews(Dataset):
    def __init__(self, imgs, poses, focal):
        self.imgs, self.poses, self.focal = imgs, poses, focal

    def __len__(self):
        return self.imgs.shape[0]

    def __getitem__(self, i):
        return i, self.imgs[i], self.poses[i]


def conical_frustum_to_gaussian(rd, t0, t1, radii):
    mu, hw = (t0 + t1) / 2, (t1 - t0) / 2
    t_mean = mu + (2 * mu * hw ** 2) / (3 * mu ** 2 + hw ** 2)
    t_var = hw ** 2 / 3 - (4 / 15) * (hw ** 4 * (12 * mu ** 2 - hw ** 2)) / (3 * mu ** 2 + hw ** 2) ** 2
    r_var = radii[:, None] ** 2 * (mu ** 2 / 4 + (5 / 12) * hw ** 2 - (4 / 15) * hw ** 4 / (3 * mu ** 2 + hw ** 2))
    mean = rd[:, None] * t_mean[..., None]
    d2 = rd ** 2
    null_outer = 1 - d2 / d2.sum(-1, keepdim=True).clamp_min(1e-10)
    cov_diag = t_var[..., None] * d2[:, None] + r_var[..., None] * null_outer[:, None]
    return mean, cov_diag


def integrated_pos_enc(mean, cov_diag, min_deg=0, max_deg=16):
    scales = 2.0 ** torch.arange(min_deg, max_deg, device=mean.device)
    y = (mean[..., None, :] * scales[:, None]).flatten(-2)
    y_var = (cov_diag[..., None, :] * scales[:, None] ** 2).flatten(-2)
    return torch.cat([torch.sin(y) * torch.exp(-0.5 * y_var), torch.cos(y) * torch.exp(-0.5 * y_var)], -1)


class MipNeRF(nn.Module):
    def __init__(self, W=256, num_samples=128, near=2.0, far=6.0):
        super().__init__()
        self.num_samples, self.near, self.far = num_samples, near, far
        d_in = 2 * 3 * 16
        self.l1 = nn.Sequential(nn.Linear(d_in, W), nn.ReLU(), *[x for _ in range(3) for x in (nn.Linear(W, W), nn.ReLU())])
        self.l2 = nn.Sequential(nn.Linear(W + d_in, W), nn.ReLU(), *[x for _ in range(3) for x in (nn.Linear(W, W), nn.ReLU())])
        self.sigma = nn.Linear(W, 1)
        self.bottleneck = nn.Linear(W, W)
        self.rgb = nn.Sequential(nn.Linear(W + 27, W // 2), nn.ReLU(), nn.Linear(W // 2, 3))

    def _mlp(self, enc, viewdirs):
        h = self.l1(enc)
        h = self.l2(torch.cat([h, enc], -1))
        sigma = F.softplus(self.sigma(h)[..., 0] - 1.0)
        vd = torch.cat([viewdirs] + [f(viewdirs * 2 ** i) for i in range(4) for f in (torch.sin, torch.cos)], -1)
        vd = vd[:, None].expand(-1, h.shape[1], -1)
        rgb = torch.sigmoid(self.rgb(torch.cat([self.bottleneck(h), vd], -1))) * 1.002 - 0.001
        return rgb, sigma

    def _render(self, ro, rd, radii, t):
        mean, cov = conical_frustum_to_gaussian(rd, t[:, :-1], t[:, 1:], radii)
        mean = mean + ro[:, None]
        rgb, sigma = self._mlp(integrated_pos_enc(mean, cov), F.normalize(rd, dim=-1))
        delta = (t[:, 1:] - t[:, :-1]) * rd.norm(dim=-1, keepdim=True)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True)), w

    def forward(self, ro, rd, radii):
        n = ro.shape[0]
        t = torch.linspace(self.near, self.far, self.num_samples + 1, device=ro.device).expand(n, -1)
        if self.training:
            mids = 0.5 * (t[:, 1:] + t[:, :-1])
            lo, hi = torch.cat([t[:, :1], mids], -1), torch.cat([mids, t[:, -1:]], -1)
            t = lo + (hi - lo) * torch.rand_like(t)
        rgb_c, w = self._render(ro, rd, radii, t)
        # resample (same MLP, mip-NeRF style) with blurred weights
        with torch.no_grad():
            wp = torch.cat([w[:, :1], w, w[:, -1:]], -1)
            wb = 0.5 * (torch.maximum(wp[:, :-2], wp[:, 1:-1]) + torch.maximum(wp[:, 1:-1], wp[:, 2:])) + 0.01
            cdf = F.pad(torch.cumsum(wb / wb.sum(-1, keepdim=True), -1), (1, 0)).clamp(max=1.0)
            u = torch.linspace(0, 1 - 1e-6, self.num_samples + 1, device=ro.device).expand(n, -1).contiguous()
            if self.training:
                u = (u + torch.rand_like(u[:, :1]) / (self.num_samples + 1)).clamp(max=1 - 1e-6)
            idx = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[1] - 1)
            c0, c1 = cdf.gather(1, idx - 1), cdf.gather(1, idx)
            b0, b1 = t.gather(1, idx - 1), t.gather(1, idx)
            t2 = b0 + (u - c0) / (c1 - c0).clamp_min(1e-8) * (b1 - b0)
        rgb_f, _ = self._render(ro, rd, radii, t2)
        return rgb_c, rgb_f


def lr_at(step, a):
    w = min(1.0, step / a.warmup) if a.warmup else 1.0
    t = min(step / a.max_steps, 1.0)
    return w * math.exp(math.log(a.lr_init) * (1 - t) + math.log(a.lr_final) * t)


@torch.no_grad()
def evaluate(model, loader, H, W, focal, device, lpips_fn, save_dir=None):
    model.eval()
    psnrs, ssims, lpipss = [], [], []
    yy, xx = torch.meshgrid(torch.arange(H, device=device).float(), torch.arange(W, device=device).float(), indexing="ij")
    for idx, img, c2w in loader:
        c2w = c2w[0].to(device)
        ro, rd, radii = camera_rays(c2w.expand(H * W, 4, 4), yy.reshape(-1), xx.reshape(-1), H, W, focal)
        pred = torch.cat([model(ro[s:s + 8192], rd[s:s + 8192], radii[s:s + 8192])[1]
                          for s in range(0, H * W, 8192)]).view(H, W, 3).clamp(0, 1)
        gt = img[0].to(device)
        psnrs.append(-10 * torch.log10(F.mse_loss(pred, gt)).item())
        p, g = pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]
        ssims.append(ssim_fn(p, g, data_range=1.0).item())
        lpipss.append(lpips_fn(p * 2 - 1, g * 2 - 1).item())
        if save_dir is not None:
            imageio.imwrite(os.path.join(save_dir, f"{int(idx):03d}.png"), (pred.cpu().numpy() * 255).astype(np.uint8))
    model.train()
    return float(np.mean(psnrs)), float(np.mean(ssims)), float(np.mean(lpipss))


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(20211)
    g = torch.Generator(device=device).manual_seed(20211 + rank)

    imgs, poses, focal = load_blender(args.scene, "train")
    test_imgs, test_poses, _ = load_blender(args.scene, "test")
    N, H, W = imgs.shape[:3]
    imgs, poses = imgs.to(device), poses.to(device)
    test_set = TestViews(test_imgs, test_poses, focal)
    test_loader = DataLoader(test_set, batch_size=1, sampler=DistributedSampler(test_set, shuffle=False), num_workers=2)
    lpips_fn = lpips.LPIPS(net="alex", verbose=False).to(device)

    model = DDP(MipNeRF(num_samples=args.num_samples).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr_init)
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "model.pt")
    step0 = 0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step0 = sd["step"]

    rays_per_rank = args.batch_size // world
    t0 = time.time()
    for step in range(step0 + 1, (0 if args.eval_only else args.max_steps) + 1):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args)
        i = torch.randint(0, N, (rays_per_rank,), device=device, generator=g)
        y = torch.randint(0, H, (rays_per_rank,), device=device, generator=g)
        x = torch.randint(0, W, (rays_per_rank,), device=device, generator=g)
        ro, rd, radii = camera_rays(poses[i], y.float(), x.float(), H, W, focal)
        target = imgs[i, y, x]
        rgb_c, rgb_f = model(ro, rd, radii)
        loss = 0.1 * F.mse_loss(rgb_c, target) + F.mse_loss(rgb_f, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        if step % args.log_every == 0:
            mse = F.mse_loss(rgb_f.detach(), target)
            dist.all_reduce(mse, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"{step:7d} psnr={-10 * torch.log10(mse).item():.2f} lr={lr_at(step, args):.2e} "
                      f"{(time.time() - t0) / (step - step0):.3f}s/it", flush=True)
        if step % args.ckpt_every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)

    dist.barrier()
    render_dir = os.path.join(args.out, "test_renders")
    os.makedirs(render_dir, exist_ok=True)
    psnr, ssim, lp = evaluate(model.module, test_loader, H, W, focal, device, lpips_fn, render_dir)
    if rank == 0:
        print(f"TEST  PSNR {psnr:.2f}  SSIM {ssim:.4f}  LPIPS {lp:.4f}")
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump({"psnr": psnr, "ssim": ssim, "lpips": lp, "num_views": len(test_set)}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
