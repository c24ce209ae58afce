#
# Multi-GPU 3D Gaussian Splatting (diff-gaussian-rasterization backend).
# Each process keeps a replica of the Gaussians, renders its own training view per
# iteration, and gradients / densification statistics are summed over processes.
#
#   torchrun --nproc_per_node=4 07_gs_ddp_blender.py -s data/nerf_synthetic/ship -m output/ship_4gpu
#
import json
import math
import os
from argparse import ArgumentParser

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diff_gaussian_rasterization import GaussianRasterizationSettings, GaussianRasterizer
from PIL import Image
from simple_knn._C import distCUDA2
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEVICE = torch.device("cuda:0")
C0 = 0.28209479177387814


def fov2focal(fov, pixels):
    return pixels / (2 * math.tan(fov / 2))


def projection_matrix(znear, zfar, fovx, fovy):
    tx, ty = math.tan(fovx / 2), math.tan(fovy / 2)
    P = torch.zeros(4, 4)
    P[0, 0], P[1, 1] = 1 / tx, 1 / ty
    P[3, 2] = 1.0
    P[2, 2] = zfar / (zfar - znear)
    P[2, 3] = -(zfar * znear) / (zfar - znear)
    return P


class Camera:
    def __init__(self, c2w, fovx, image, znear=0.01, zfar=100.0):
        self.image = image
        self.H, self.W = image.shape[1:]
        self.fovx = fovx
        self.fovy = 2 * math.atan(math.tan(fovx / 2) * self.H / self.W)
        c2w = c2w.clone()
        c2w[:3, 1:3] *= -1
        w2c = torch.linalg.inv(c2w)
        self.world_view = w2c.T.contiguous()
        self.full_proj = (self.world_view @ projection_matrix(znear, zfar, self.fovx, self.fovy).T).contiguous()
        self.center = c2w[:3, 3].contiguous()

    def to(self, device):
        self.world_view, self.full_proj, self.center = (t.to(device) for t in (self.world_view, self.full_proj, self.center))
        return self


def read_cameras(path, split, white_background=True):
    meta = json.load(open(os.path.join(path, f"transforms_{split}.json")))
    cams = []
    for fr in meta["frames"]:
        rgba = np.array(Image.open(os.path.join(path, fr["file_path"] + ".png")), dtype=np.float32) / 255.0
        bg = 1.0 if white_background else 0.0
        rgb = rgba[..., :3] * rgba[..., 3:4] + bg * (1 - rgba[..., 3:4])
        img = torch.from_numpy(rgb).permute(2, 0, 1).to(DEVICE, non_blocking=True)
        cams.append(Camera(torch.tensor(fr["transform_matrix"], dtype=torch.float32), meta["camera_angle_x"], img))
    return cams


def build_rotation(r):
    r = F.normalize(r, dim=-1)
    w, x, y, z = r.unbind(-1)
    R = torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                     2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                     2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1)
    return R.view(-1, 3, 3)


class GaussianModel:
    KEYS = ("xyz", "f_dc", "f_rest", "opacity", "scaling", "rotation")

    def __init__(self, sh_degree, xyz, device):
        n = xyz.shape[0]
        self.max_sh_degree, self.active_sh_degree = sh_degree, 0
        rgb = torch.rand(n, 3, device=device)
        self.p = {
            "xyz": xyz,
            "f_dc": ((rgb - 0.5) / C0)[:, None],
            "f_rest": torch.zeros(n, (sh_degree + 1) ** 2 - 1, 3, device=device),
            "opacity": torch.logit(0.1 * torch.ones(n, 1, device=device)),
            "scaling": torch.log(torch.sqrt(distCUDA2(xyz).clamp_min(1e-7)))[:, None].repeat(1, 3),
            "rotation": F.pad(torch.ones(n, 1, device=device), (0, 3)),
        }
        self.p = {k: torch.nn.Parameter(v.contiguous()) for k, v in self.p.items()}
        self.xyz_grad_accum = torch.zeros(n, 1, device=device)
        self.denom = torch.zeros(n, 1, device=device)

    def setup_optimizer(self, spatial_lr_scale, batch_scale=1.0):
        lrs = dict(xyz=1.6e-4 * spatial_lr_scale, f_dc=2.5e-3, f_rest=2.5e-3 / 20, opacity=0.05, scaling=5e-3, rotation=1e-3)
        lrs = {k: v * batch_scale for k, v in lrs.items()}
        self.optimizer = torch.optim.Adam([{"params": [self.p[k]], "lr": lrs[k], "name": k} for k in self.KEYS], eps=1e-15)
        self.xyz_lr = (lrs["xyz"], 1.6e-6 * spatial_lr_scale * batch_scale)

    def update_lr(self, it, max_steps):
        t = min(it / max_steps, 1.0)
        lr = math.exp(math.log(self.xyz_lr[0]) * (1 - t) + math.log(self.xyz_lr[1]) * t)
        self.optimizer.param_groups[0]["lr"] = lr

    def _swap(self, fn_param, fn_state):
        for group in self.optimizer.param_groups:
            old = group["params"][0]
            new = torch.nn.Parameter(fn_param(group["name"], old.detach()))
            state = self.optimizer.state.pop(old, None)
            if state is not None:
                state["exp_avg"], state["exp_avg_sq"] = fn_state(state["exp_avg"]), fn_state(state["exp_avg_sq"])
                self.optimizer.state[new] = state
            group["params"][0] = new
            self.p[group["name"]] = new

    def add_points(self, d):
        n_new = d["xyz"].shape[0]
        self._swap(lambda k, t: torch.cat([t, d[k]]), lambda s: torch.cat([s, s.new_zeros((n_new, *s.shape[1:]))]))

    def keep_points(self, mask):
        self._swap(lambda k, t: t[mask], lambda s: s[mask])

    @torch.no_grad()
    def densify_and_prune(self, max_grad, min_opacity, extent, gen):
        grads = (self.xyz_grad_accum / self.denom).nan_to_num(0.0).squeeze(-1)
        n0 = grads.shape[0]
        max_scale = self.p["scaling"].exp().max(1).values
        clone = (grads >= max_grad) & (max_scale <= 0.01 * extent)
        self.add_points({k: self.p[k][clone] for k in self.KEYS})
        split = torch.zeros(self.p["xyz"].shape[0], dtype=torch.bool, device=grads.device)
        split[:n0] = (grads >= max_grad) & (max_scale > 0.01 * extent)
        stds = self.p["scaling"][split].exp().repeat(2, 1)
        samples = torch.randn(stds.shape, device=stds.device, generator=gen) * stds
        rots = build_rotation(self.p["rotation"][split]).repeat(2, 1, 1)
        new = {k: self.p[k][split].repeat(2, *[1] * (self.p[k].dim() - 1)) for k in self.KEYS}
        new["xyz"] = torch.bmm(rots, samples[..., None]).squeeze(-1) + new["xyz"]
        new["scaling"] = torch.log(new["scaling"].exp() / 1.6)
        self.add_points(new)
        prune = torch.cat([split, torch.zeros(new["xyz"].shape[0], dtype=torch.bool, device=split.device)])
        prune |= (torch.sigmoid(self.p["opacity"]) < min_opacity).squeeze(-1)
        prune |= self.p["scaling"].exp().max(1).values > 0.1 * extent
        self.keep_points(~prune)
        n = self.p["xyz"].shape[0]
        self.xyz_grad_accum = torch.zeros(n, 1, device=grads.device)
        self.denom = torch.zeros(n, 1, device=grads.device)

    @torch.no_grad()
    def reset_opacity(self):
        ceiling = math.log(0.01 / 0.99)
        self._swap(lambda k, t: t.clamp(max=ceiling) if k == "opacity" else t,
                   lambda s: s)
        self.optimizer.state[self.p["opacity"]] = {k: (torch.zeros_like(v) if torch.is_tensor(v) and v.dim() > 0 else v)
                                                   for k, v in self.optimizer.state[self.p["opacity"]].items()}


def render(cam, gs, bg):
    means2D = torch.zeros_like(gs.p["xyz"], requires_grad=True)
    means2D.retain_grad()
    settings = GaussianRasterizationSettings(
        image_height=int(cam.H), image_width=int(cam.W), tanfovx=math.tan(cam.fovx * 0.5), tanfovy=math.tan(cam.fovy * 0.5),
        bg=bg, scale_modifier=1.0, viewmatrix=cam.world_view, projmatrix=cam.full_proj, sh_degree=gs.active_sh_degree,
        campos=cam.center, prefiltered=False, debug=False)
    image, radii = GaussianRasterizer(raster_settings=settings)(
        means3D=gs.p["xyz"], means2D=means2D, shs=torch.cat([gs.p["f_dc"], gs.p["f_rest"]], 1), colors_precomp=None,
        opacities=torch.sigmoid(gs.p["opacity"]), scales=gs.p["scaling"].exp(), rotations=F.normalize(gs.p["rotation"], dim=-1),
        cov3D_precomp=None)
    return image, means2D, radii


def main():
    ap = ArgumentParser()
    ap.add_argument("-s", "--source_path", required=True)
    ap.add_argument("-m", "--model_path", required=True)
    ap.add_argument("--iterations", type=int, default=30_000)
    ap.add_argument("--sh_degree", type=int, default=3)
    ap.add_argument("--densify_grad_threshold", type=float, default=2e-4)
    ap.add_argument("--lambda_dssim", type=float, default=0.2)
    ap.add_argument("--num_pts", type=int, default=100_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_cams = [c.to(device) for c in read_cameras(args.source_path, "train")]
    test_cams = [c.to(device) for c in read_cameras(args.source_path, "test")]
    centers = torch.stack([c.center for c in train_cams])
    extent = (centers - centers.mean(0)).norm(dim=1).max().item() * 1.1

    torch.manual_seed(0)
    xyz = (torch.rand(args.num_pts, 3, device=device) * 2.6 - 1.3)
    gs = GaussianModel(args.sh_degree, xyz, device)
    for k in gs.KEYS:
        dist.broadcast(gs.p[k].data, src=0)
    gs.setup_optimizer(extent, batch_scale=math.sqrt(world))  # world views per step
    bg = torch.ones(3, device=device)
    split_gen = torch.Generator(device=device).manual_seed(1)
    pick = np.random.default_rng(2024)

    for it in range(1, args.iterations + 1):
        gs.update_lr(it, args.iterations)
        if it % 1000 == 0:
            gs.active_sh_degree = min(gs.active_sh_degree + 1, gs.max_sh_degree)
        cam_ids = pick.choice(len(train_cams), size=world, replace=len(train_cams) < world)
        cam = train_cams[cam_ids[rank]]
        image, means2D, radii = render(cam, gs, bg)
        gt = cam.image.to(device, non_blocking=True)
        Ll1 = (image - gt).abs().mean()
        mu_x, mu_y = F.avg_pool2d(image[None], 11, 1, 5), F.avg_pool2d(gt[None], 11, 1, 5)
        sxx = F.avg_pool2d(image[None] ** 2, 11, 1, 5) - mu_x ** 2
        syy = F.avg_pool2d(gt[None] ** 2, 11, 1, 5) - mu_y ** 2
        sxy = F.avg_pool2d(image[None] * gt[None], 11, 1, 5) - mu_x * mu_y
        ssim = ((2 * mu_x * mu_y + 1e-4) * (2 * sxy + 9e-4) / ((mu_x ** 2 + mu_y ** 2 + 1e-4) * (sxx + syy + 9e-4))).mean()
        loss = (1 - args.lambda_dssim) * Ll1 + args.lambda_dssim * (1 - ssim)
        loss.backward()

        grads = [gs.p[k].grad for k in gs.KEYS]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(world)
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(s)

        with torch.no_grad():
            if it < 15_000:
                vis = radii > 0
                gs.xyz_grad_accum[vis] += means2D.grad[vis, :2].norm(dim=-1, keepdim=True)
                gs.denom[vis] += 1
                if it > 500 and it % 100 == 0:
                    dist.all_reduce(gs.xyz_grad_accum)
                    dist.all_reduce(gs.denom)
                    gs.densify_and_prune(args.densify_grad_threshold, 0.005, extent, split_gen)
                if it % 3000 == 0:
                    gs.reset_opacity()
            gs.optimizer.step()
            gs.optimizer.zero_grad(set_to_none=True)

        if it % 500 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l)
            if rank == 0:
                print(f"[ITER {it}] loss {l.item() / world:.5f}  points {gs.p['xyz'].shape[0]}", flush=True)

        if it in (7000, args.iterations):
            with torch.no_grad():
                acc = torch.zeros(2, device=device)
                for cam in test_cams[rank::world]:
                    img = render(cam, gs, bg)[0].clamp(0, 1)
                    acc[0] += -10 * torch.log10(F.mse_loss(img, cam.image.to(device)))
                    acc[1] += 1
                dist.all_reduce(acc)
            if rank == 0:
                print(f"[ITER {it}] test PSNR {(acc[0] / acc[1]).item():.2f}", flush=True)
                os.makedirs(args.model_path, exist_ok=True)
                torch.save({k: v.detach().cpu() for k, v in gs.p.items()}, os.path.join(args.model_path, f"point_cloud_{it}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
