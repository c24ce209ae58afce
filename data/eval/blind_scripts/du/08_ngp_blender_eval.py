"""Hash-grid NeRF (tiny-cuda-nn) on NeRF-synthetic, DDP over the ray batch.

Final evaluation renders the 200 test views (split over the GPUs) and writes
PSNR / SSIM / LPIPS to results.json.

    torchrun --nproc_per_node=4 08_ngp_blender_eval.py --scene /data/nerf_synthetic/lego --out runs/lego
"""
import argparse
import json
import math
import os

import imageio.v2 as imageio
import lpips
import numpy as np
import tinycudann as tcnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from skimage.metrics import structural_similarity
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

AABB = 1.5


def load_split(root, split):
    with open(os.path.join(root, f"transforms_{split}.json")) as f:
        meta = json.load(f)
    imgs, poses = [], []
    for fr in meta["frames"]:
        im = imageio.imread(os.path.join(root, fr["file_path"] + ".png")).astype(np.float32) / 255.0
        imgs.append(im[..., :3] * im[..., 3:] + (1 - im[..., 3:]))  # white background
        poses.append(np.array(fr["transform_matrix"], dtype=np.float32))
    imgs = torch.from_numpy(np.stack(imgs))
    focal = 0.5 * imgs.shape[2] / math.tan(0.5 * meta["camera_angle_x"])
    return imgs, torch.from_numpy(np.stack(poses)), focal


def pixel_rays(pose, focal, H, W, xs, ys):
    d = torch.stack([(xs + 0.5 - W / 2) / focal, -(ys + 0.5 - H / 2) / focal, -torch.ones_like(xs)], -1)
    d = (pose[..., :3, :3] @ d[..., None]).squeeze(-1)
    return pose[..., :3, 3].expand_as(d), F.normalize(d, dim=-1)


class NGP(nn.Module):
    def __init__(self, n_levels=16, log2_T=19):
        super().__init__()
        per_level = math.exp(math.log(2048 * AABB / 16) / (n_levels - 1))
        self.density = tcnn.NetworkWithInputEncoding(3, 16, {
            "otype": "HashGrid", "n_levels": n_levels, "n_features_per_level": 2,
            "log2_hashmap_size": log2_T, "base_resolution": 16, "per_level_scale": per_level},
            {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
             "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.color = tcnn.Network(32, 3, {"otype": "FullyFusedMLP", "activation": "ReLU",
                                          "output_activation": "Sigmoid", "n_neurons": 64, "n_hidden_layers": 2})

    def forward(self, rays_o, rays_d, n_samples=192, perturb=True):
        # intersect with the scene box
        inv = 1.0 / torch.where(rays_d.abs() < 1e-8, torch.full_like(rays_d, 1e-8), rays_d)
        t0, t1 = (-AABB - rays_o) * inv, (AABB - rays_o) * inv
        near = torch.minimum(t0, t1).amax(-1).clamp_min(0.05)
        far = torch.maximum(t0, t1).amin(-1).clamp_min(near + 1e-3)
        t = torch.linspace(0, 1, n_samples, device=rays_o.device)
        z = near[:, None] + (far - near)[:, None] * t
        if perturb:
            z = z + torch.rand_like(z) * ((far - near) / n_samples)[:, None]
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        x = ((pts / AABB) + 1) / 2
        h = self.density(x.reshape(-1, 3)).float()
        sigma = torch.exp(h[:, 0].clamp_max(15)).reshape(z.shape)
        dirs = (rays_d[:, None].expand_as(pts).reshape(-1, 3) + 1) / 2
        rgb = self.color(torch.cat([self.dir_enc(dirs), h], -1)).float().reshape(*z.shape, 3)
        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
        alpha = 1 - torch.exp(-sigma * delta)
        w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True))


@torch.no_grad()
def render_view(net, pose, focal, H, W, chunk=1 << 14):
    ys, xs = torch.meshgrid(torch.arange(H, device=pose.device, dtype=torch.float32),
                            torch.arange(W, device=pose.device, dtype=torch.float32), indexing="ij")
    o, d = pixel_rays(pose, focal, H, W, xs.reshape(-1), ys.reshape(-1))
    return torch.cat([net(o[i:i + chunk], d[i:i + chunk], perturb=False) for i in range(0, o.shape[0], chunk)]).reshape(H, W, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--rays", type=int, default=1 << 16, help="rays per step over all GPUs")
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    imgs, poses, focal = load_split(args.scene, "train")
    imgs, poses = imgs.to(dev), poses.to(dev)
    N, H, W = imgs.shape[:3]

    model = DDP(NGP().to(dev), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-15)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, [args.steps // 2, args.steps * 3 // 4, args.steps * 9 // 10], 0.33)
    writer = SummaryWriter(args.out) if rank == 0 else None
    per_rank = args.rays // world

    for step in range(1, args.steps + 1):
        v = torch.randint(0, N, (per_rank,), device=dev)
        xs = torch.randint(0, W, (per_rank,), device=dev)
        ys = torch.randint(0, H, (per_rank,), device=dev)
        o, d = pixel_rays(poses[v], focal, H, W, xs.float(), ys.float())
        rgb = model(o, d)
        loss = F.mse_loss(rgb, imgs[v, ys, xs])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        if step % 500 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("train/psnr", -10 * math.log10(l.item()), step)
                print(f"step {step}  psnr {-10 * math.log10(l.item()):.2f}", flush=True)

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out, "ngp.pt"))

    # ---- test set ----
    test_imgs, test_poses, focal = load_split(args.scene, "test")
    lpips_fn = lpips.LPIPS(net="vgg").to(dev).eval()
    net = model.module.eval()
    psnrs, ssims, lpipss = [], [], []
    os.makedirs(os.path.join(args.out, "test"), exist_ok=True)
    for i in range(rank, len(test_imgs), world):
        pred = render_view(net, test_poses[i].to(dev), focal, H, W).clamp(0, 1)
        gt = test_imgs[i].to(dev)
        psnrs.append(-10 * torch.log10(F.mse_loss(pred, gt)).item())
        p_np, g_np = pred.cpu().numpy(), gt.cpu().numpy()
        ssims.append(structural_similarity(p_np, g_np, channel_axis=-1, data_range=1.0))
        with torch.no_grad():
            lpipss.append(lpips_fn(pred.permute(2, 0, 1)[None] * 2 - 1, gt.permute(2, 0, 1)[None] * 2 - 1).item())
        imageio.imwrite(os.path.join(args.out, "test", f"r_{i:03d}.png"), (p_np * 255).astype(np.uint8))

    results = {"psnr": float(np.mean(psnrs)), "ssim": float(np.mean(ssims)), "lpips": float(np.mean(lpipss)),
               "n_views": len(psnrs)}
    if rank == 0:
        print(json.dumps(results, indent=2))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        writer.add_scalar("test/psnr", results["psnr"], args.steps)
        writer.add_scalar("test/ssim", results["ssim"], args.steps)
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
