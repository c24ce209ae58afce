"""Fixed-budget 3D Gaussian scene fitting with gsplat, training views split over the GPUs of one node.

    python fit_gaussians.py --scene data/garden --iters 30000 --num_gaussians 1000000

Scene folder (nerfstudio-style):
    transforms.json  - per-frame c2w (OpenGL), fl_x, fl_y, cx, cy, w, h, file_path
    points3D.npy     - (N, 6) xyz + rgb sparse SfM points for initialisation
"""
import argparse
import json
import math
import os

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from gsplat import rasterization
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SH_C0 = 0.28209479177387814


class SceneViews(Dataset):
    def __init__(self, scene_dir, split, downscale=4, test_every=8):
        with open(os.path.join(scene_dir, "transforms.json")) as f:
            meta = json.load(f)
        frames = sorted(meta["frames"], key=lambda fr: fr["file_path"])
        idx = [i for i in range(len(frames)) if (i % test_every == 0) == (split == "test")]
        self.frames = [frames[i] for i in idx]
        self.meta, self.dir, self.ds = meta, scene_dir, downscale

    def __len__(self):
        return len(self.frames)

    def __getitem__(self, i):
        fr = self.frames[i]
        img = imageio.imread(os.path.join(self.dir, fr["file_path"]))[..., :3]
        img = torch.from_numpy(img).float().permute(2, 0, 1)[None] / 255.0
        img = F.interpolate(img, scale_factor=1 / self.ds, mode="area")[0].permute(1, 2, 0)
        H, W = img.shape[:2]
        sx = W / fr.get("w", self.meta["w"])
        sy = H / fr.get("h", self.meta["h"])
        K = torch.tensor([[fr.get("fl_x", self.meta["fl_x"]) * sx, 0, fr.get("cx", self.meta["cx"]) * sx],
                          [0, fr.get("fl_y", self.meta["fl_y"]) * sy, fr.get("cy", self.meta["cy"]) * sy],
                          [0, 0, 1]], dtype=torch.float32)
        c2w = torch.tensor(fr["transform_matrix"], dtype=torch.float32)
        c2w[:3, 1:3] *= -1  # OpenGL -> OpenCV
        return {"image": img, "K": K, "viewmat": torch.linalg.inv(c2w)}


class GaussianModel(nn.Module):
    def __init__(self, pts, rgb, n_max):
        super().__init__()
        if len(pts) > n_max:
            sel = torch.randperm(len(pts))[:n_max]
            pts, rgb = pts[sel], rgb[sel]
        d = torch.cdist(pts[:4096], pts).topk(4, largest=False).values[:, 1:].mean(-1)
        scale0 = d.mean().clamp(min=1e-4).log().expand(len(pts), 3).clone()
        self.means = nn.Parameter(pts.clone())
        self.log_scales = nn.Parameter(scale0)
        self.quats = nn.Parameter(torch.tensor([1.0, 0, 0, 0]).repeat(len(pts), 1))
        self.opacity_logits = nn.Parameter(torch.logit(torch.full((len(pts),), 0.1)))
        self.sh0 = nn.Parameter((rgb - 0.5) / SH_C0)

    def forward(self, viewmats, Ks, width, height):
        colors = (self.sh0 * SH_C0 + 0.5).clamp(0, 1)
        scales = self.log_scales.exp()
        render, alpha, info = rasterization(
            means=self.means, quats=F.normalize(self.quats, dim=-1), scales=scales,
            opacities=torch.sigmoid(self.opacity_logits), colors=colors,
            viewmats=viewmats, Ks=Ks, width=width, height=height, packed=False)
        return render, alpha, scales


def gaussian_window(size=11, sigma=1.5, device="cpu"):
    g = torch.exp(-((torch.arange(size, device=device) - size // 2) ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] @ g[None]).expand(3, 1, size, size).contiguous()


def ssim(x, y, win):
    C1, C2 = 0.01 ** 2, 0.03 ** 2
    mu_x, mu_y = F.conv2d(x, win, padding=5, groups=3), F.conv2d(y, win, padding=5, groups=3)
    sxx = F.conv2d(x * x, win, padding=5, groups=3) - mu_x ** 2
    syy = F.conv2d(y * y, win, padding=5, groups=3) - mu_y ** 2
    sxy = F.conv2d(x * y, win, padding=5, groups=3) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + C1) * (2 * sxy + C2)) / ((mu_x ** 2 + mu_y ** 2 + C1) * (sxx + syy + C2))
    return s.mean()


def run(rank, world_size, cfg):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}")

    train_views = SceneViews(cfg.scene, "train", cfg.downscale)
    test_views = SceneViews(cfg.scene, "test", cfg.downscale)
    sampler = DistributedSampler(train_views, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_views, batch_size=1, sampler=sampler, num_workers=2, pin_memory=True)

    torch.manual_seed(cfg.seed)
    sfm = torch.from_numpy(np.load(os.path.join(cfg.scene, "points3D.npy"))).float()
    model = GaussianModel(sfm[:, :3], sfm[:, 3:6] / 255.0, cfg.num_gaussians).to(device)
    ddp = DDP(model, device_ids=[rank], broadcast_buffers=False)

    scene_extent = (model.means.detach() - model.means.detach().mean(0)).norm(dim=-1).max().item()
    optim = torch.optim.Adam([
        {"params": [model.means], "lr": 1.6e-4 * scene_extent, "name": "means"},
        {"params": [model.log_scales], "lr": 5e-3, "name": "scales"},
        {"params": [model.quats], "lr": 1e-3, "name": "quats"},
        {"params": [model.opacity_logits], "lr": 5e-2, "name": "opacities"},
        {"params": [model.sh0], "lr": 2.5e-3, "name": "sh0"},
    ], eps=1e-15)
    means_lr0 = optim.param_groups[0]["lr"]
    win = gaussian_window(device=device)

    out_dir = os.path.join(cfg.out, os.path.basename(os.path.normpath(cfg.scene)))
    ckpt_file = os.path.join(out_dir, "ckpt.pt")
    step = 0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.load_state_dict(ck["splats"])
        optim.load_state_dict(ck["optim"])
        step = ck["step"]

    epoch = step // max(len(loader), 1)
    while step < cfg.iters:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step >= cfg.iters:
                break
            gt = batch["image"].to(device, non_blocking=True)
            H, W = gt.shape[1:3]
            render, _, scales = ddp(batch["viewmat"].to(device), batch["K"].to(device), W, H)
            pred = render.permute(0, 3, 1, 2)
            tgt = gt.permute(0, 3, 1, 2)
            l1 = (pred - tgt).abs().mean()
            loss = 0.8 * l1 + 0.2 * (1.0 - ssim(pred, tgt, win))
            loss = loss + cfg.scale_reg * scales.amax(-1).mean()
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1

            t = min(step / cfg.iters, 1.0)
            optim.param_groups[0]["lr"] = means_lr0 * math.exp((1 - t) * math.log(1.0) + t * math.log(0.01))
            if step % cfg.reset_opacity_every == 0 and step < cfg.iters * 0.5:
                with torch.no_grad():
                    model.opacity_logits.clamp_(max=torch.logit(torch.tensor(0.01)).item())
                optim.state[model.opacity_logits].clear()

            if step % 100 == 0:
                stats = torch.stack([loss.detach(), l1.detach()])
                dist.all_reduce(stats)
                stats /= world_size
                if rank == 0:
                    print(f"step {step} loss {stats[0]:.4f} l1 {stats[1]:.4f}", flush=True)

            if step % cfg.eval_every == 0 or step == cfg.iters:
                model.eval()
                acc = torch.zeros(2, device=device, dtype=torch.float64)
                with torch.no_grad():
                    for i in range(rank, len(test_views), world_size):
                        v = test_views[i]
                        img = v["image"].to(device)
                        r, _, _ = model(v["viewmat"][None].to(device), v["K"][None].to(device),
                                     img.shape[1], img.shape[0])
                        mse = F.mse_loss(r[0].clamp(0, 1), img)
                        acc[0] += -10.0 * torch.log10(mse)
                        acc[1] += 1
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    print(f"step {step} test PSNR {(acc[0] / acc[1]).item():.2f}", flush=True)
                    os.makedirs(out_dir, exist_ok=True)
                    torch.save({"splats": model.state_dict(), "optim": optim.state_dict(), "step": step},
                               ckpt_file)
                dist.barrier()
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--out", default="results/gs")
    p.add_argument("--iters", type=int, default=30000)
    p.add_argument("--num_gaussians", type=int, default=1_000_000)
    p.add_argument("--downscale", type=int, default=4)
    p.add_argument("--scale_reg", type=float, default=0.01)
    p.add_argument("--reset_opacity_every", type=int, default=3000)
    p.add_argument("--eval_every", type=int, default=7000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--port", type=int, default=29511)
    cfg = p.parse_args()

    ngpus = torch.cuda.device_count()
    mp.spawn(run, args=(cfg, ngpus), nprocs=ngpus, join=True)
