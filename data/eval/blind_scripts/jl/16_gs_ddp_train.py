"""Fixed-budget Gaussian Splatting from a dense MVS point cloud, DDP over GPUs.

No densification: the Gaussians are initialised from a dense (OpenMVS / COLMAP fused)
cloud, so the parameter shapes never change and the splat model can live inside DDP.
Each rank renders its own batch of training views every step.

    torchrun --nproc_per_node=4 16_gs_ddp_train.py --scene data/tnt/Barn --out out/barn_fixed
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
from diff_gaussian_rasterization import GaussianRasterizationSettings, GaussianRasterizer
from lpips import LPIPS
from PIL import Image
from plyfile import PlyData
from simple_knn._C import distCUDA2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--views_per_step", type=int, default=8, help="training views per optimizer step, all GPUs")
    ap.add_argument("--resolution", type=int, default=2, help="image downscale factor")
    ap.add_argument("--lambda_dssim", type=float, default=0.2)
    ap.add_argument("--max_points", type=int, default=3_000_000)
    return ap.parse_args()


def getProjectionMatrix(znear, zfar, fovX, fovY):
    tanY, tanX = math.tan(fovY / 2), math.tan(fovX / 2)
    top, right = tanY * znear, tanX * znear
    P = torch.zeros(4, 4)
    P[0, 0] = 2.0 * znear / (2 * right)
    P[1, 1] = 2.0 * znear / (2 * top)
    P[3, 2] = 1.0
    P[2, 2] = zfar / (zfar - znear)
    P[2, 3] = -(zfar * znear) / (zfar - znear)
    return P


class Views(Dataset):
    def __init__(self, root, split, downscale):
        meta = json.load(open(os.path.join(root, "transforms.json")))
        frames = sorted(meta["frames"], key=lambda f: f["file_path"])
        frames = [f for i, f in enumerate(frames) if (i % 8 == 0) == (split == "test")]
        self.items = []
        for fr in frames:
            im = Image.open(os.path.join(root, fr["file_path"])).convert("RGB")
            W, H = im.width // downscale, im.height // downscale
            im = torch.from_numpy(np.asarray(im.resize((W, H), Image.LANCZOS), dtype=np.float32) / 255.0).permute(2, 0, 1)
            fx = meta["fl_x"] / downscale
            fovx, fovy = 2 * math.atan(W / (2 * fx)), 2 * math.atan(H / (2 * meta["fl_y"] / downscale))
            c2w = torch.tensor(fr["transform_matrix"], dtype=torch.float32)
            c2w[:3, 1:3] *= -1
            wv = torch.linalg.inv(c2w).T.contiguous()
            fp = (wv @ getProjectionMatrix(0.01, 100.0, fovx, fovy).T).contiguous()
            self.items.append(dict(image=im, wv=wv, fp=fp, campos=c2w[:3, 3].clone(),
                                   tanfovx=math.tan(fovx / 2), tanfovy=math.tan(fovy / 2)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Splats(nn.Module):
    def __init__(self, xyz, rgb, sh_degree=3):
        super().__init__()
        n = xyz.shape[0]
        self.sh_degree = sh_degree
        self.xyz = nn.Parameter(xyz)
        self.f_dc = nn.Parameter(((rgb - 0.5) / 0.28209479177387814)[:, None])
        self.f_rest = nn.Parameter(torch.zeros(n, (sh_degree + 1) ** 2 - 1, 3, device=xyz.device))
        self.scaling = nn.Parameter(torch.log(torch.sqrt(distCUDA2(xyz).clamp_min(1e-7)))[:, None].repeat(1, 3))
        self.rotation = nn.Parameter(F.pad(torch.ones(n, 1, device=xyz.device), (0, 3)))
        self.opacity = nn.Parameter(torch.logit(torch.full((n, 1), 0.1, device=xyz.device)))

    def forward(self, cams, active_sh):
        return [self.render(cam, active_sh) for cam in cams]

    def render(self, cam, active_sh):
        bg = torch.zeros(3, device=self.xyz.device)
        H, W = cam["image"].shape[-2:]
        rs = GaussianRasterizationSettings(
            image_height=int(H), image_width=int(W), tanfovx=cam["tanfovx"], tanfovy=cam["tanfovy"], bg=bg,
            scale_modifier=1.0, viewmatrix=cam["wv"], projmatrix=cam["fp"], sh_degree=active_sh, campos=cam["campos"],
            prefiltered=False, debug=False)
        img, _ = GaussianRasterizer(raster_settings=rs)(
            means3D=self.xyz, means2D=torch.zeros_like(self.xyz, requires_grad=True),
            shs=torch.cat([self.f_dc, self.f_rest], 1), colors_precomp=None, opacities=torch.sigmoid(self.opacity),
            scales=torch.exp(self.scaling), rotations=F.normalize(self.rotation, dim=-1), cov3D_precomp=None)
        return img


def dssim(x, y):
    mx, my = F.avg_pool2d(x, 11, 1, 5), F.avg_pool2d(y, 11, 1, 5)
    vx, vy = F.avg_pool2d(x * x, 11, 1, 5) - mx ** 2, F.avg_pool2d(y * y, 11, 1, 5) - my ** 2
    cxy = F.avg_pool2d(x * y, 11, 1, 5) - mx * my
    return 1 - ((2 * mx * my + 1e-4) * (2 * cxy + 9e-4) / ((mx ** 2 + my ** 2 + 1e-4) * (vx + vy + 9e-4))).mean()


def collate_views(batch):
    return batch


def to_dev(cam, device):
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in cam.items()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    train_set, test_set = Views(args.scene, "train", args.resolution), Views(args.scene, "test", args.resolution)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.views_per_step // world, sampler=sampler, num_workers=2,
                        collate_fn=collate_views, persistent_workers=True)

    ply = PlyData.read(os.path.join(args.scene, "dense.ply"))["vertex"]
    xyz = np.stack([ply["x"], ply["y"], ply["z"]], 1).astype(np.float32)
    rgb = np.stack([ply["red"], ply["green"], ply["blue"]], 1).astype(np.float32) / 255.0
    if xyz.shape[0] > args.max_points:
        keep = np.random.default_rng(0).choice(xyz.shape[0], args.max_points, replace=False)
        xyz, rgb = xyz[keep], rgb[keep]
    splats = Splats(torch.from_numpy(xyz).to(device), torch.from_numpy(rgb).to(device))
    model = DDP(splats, device_ids=[local_rank])

    centers = torch.stack([c["campos"] for c in train_set.items])
    extent = (centers - centers.mean(0)).norm(dim=1).max().item() * 1.1
    steps_total = args.epochs * len(loader)
    opt = torch.optim.Adam([
        {"params": [splats.xyz], "lr": 1.6e-4 * extent, "name": "xyz"},
        {"params": [splats.f_dc], "lr": 2.5e-3}, {"params": [splats.f_rest], "lr": 2.5e-3 / 20},
        {"params": [splats.opacity], "lr": 0.05}, {"params": [splats.scaling], "lr": 5e-3},
        {"params": [splats.rotation], "lr": 1e-3}], eps=1e-15)
    xyz_decay = 0.01 ** (1 / steps_total)
    lpips_fn = LPIPS(net="vgg").to(device)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for cams in loader:
            active_sh = min(step // 1000, splats.sh_degree)
            cams = [to_dev(c, device) for c in cams]
            loss = 0.0
            for img, cam in zip(model(cams, active_sh), cams):
                gt = cam["image"]
                loss = loss + ((1 - args.lambda_dssim) * (img - gt).abs().mean()
                               + args.lambda_dssim * dssim(img[None], gt[None])) / len(cams)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            opt.param_groups[0]["lr"] *= xyz_decay
            step += 1

        if epoch % 10 == 0 or epoch == args.epochs - 1:
            l = loss.detach().reshape(1)
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            m = torch.zeros(3, device=device)
            with torch.no_grad():
                for i in range(rank, len(test_set), world):
                    cam = to_dev(test_set[i], device)
                    img = splats.render(cam, splats.sh_degree).clamp(0, 1)
                    m[0] += -10 * torch.log10(F.mse_loss(img, cam["image"]))
                    m[1] += lpips_fn(img[None], cam["image"][None], normalize=True).squeeze()
                    m[2] += 1
            dist.all_reduce(m)
            if rank == 0:
                print(f"epoch {epoch:4d} step {step} train loss {l.item():.4f} | test PSNR {m[0] / m[2]:.2f} "
                      f"LPIPS {m[1] / m[2]:.4f}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in splats.state_dict().items()}, os.path.join(args.out, "splats.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
