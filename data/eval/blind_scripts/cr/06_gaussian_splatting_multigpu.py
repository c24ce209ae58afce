#
# Multi-GPU 3D Gaussian Splatting (replicated Gaussians, one camera per GPU per iteration).
#
#   torchrun --standalone --nproc_per_node=4 train_gs_multigpu.py -s data/tandt/truck -m output/truck
#
import math
import os
import random
import sys
import json
from argparse import ArgumentParser

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from plyfile import PlyData, PlyElement
from diff_gaussian_rasterization import GaussianRasterizationSettings, GaussianRasterizer
from torch.utils.tensorboard import SummaryWriter


def inverse_sigmoid(x):
    return torch.log(x / (1 - x))


def build_rotation(r):
    q = F.normalize(r, dim=-1)
    w, x, y, z = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
    return torch.stack([
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).view(-1, 3, 3)


class Camera:
    def __init__(self, image, R, T, fovx, fovy, device):
        self.image = image.to(device)
        self.H, self.W = image.shape[1:]
        self.fovx, self.fovy = fovx, fovy
        w2c = torch.eye(4)
        w2c[:3, :3] = torch.from_numpy(R).T
        w2c[:3, 3] = torch.from_numpy(T)
        self.world_view = w2c.T.to(device)
        znear, zfar = 0.01, 100.0
        tx, ty = math.tan(fovx / 2), math.tan(fovy / 2)
        P = torch.zeros(4, 4)
        P[0, 0], P[1, 1] = 1 / tx, 1 / ty
        P[2, 2], P[2, 3] = zfar / (zfar - znear), -(zfar * znear) / (zfar - znear)
        P[3, 2] = 1.0
        self.full_proj = (self.world_view[None] @ P.T.to(device)[None])[0]
        self.center = torch.inverse(self.world_view)[3, :3]


def load_cameras(source, device, resolution_scale=2):
    with open(os.path.join(source, "cameras.json")) as f:
        cams = json.load(f)
    out = []
    for c in cams:
        img = Image.open(os.path.join(source, "images", c["img_name"] + ".jpg"))
        img = img.resize((c["width"] // resolution_scale, c["height"] // resolution_scale))
        t = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)[:3]
        R = np.array(c["rotation"], dtype=np.float32)
        pos = np.array(c["position"], dtype=np.float32)
        T = -R.T @ pos
        fovx = 2 * math.atan(c["width"] / (2 * c["fx"]))
        fovy = 2 * math.atan(c["height"] / (2 * c["fy"]))
        out.append(Camera(t, R, T, fovx, fovy, device))
    return out


class GaussianModel:
    def __init__(self, sh_degree=3):
        self.max_sh_degree = sh_degree
        self.active_sh_degree = 0

    def create_from_ply(self, path, device):
        v = PlyData.read(path)["vertex"]
        xyz = torch.tensor(np.stack([v["x"], v["y"], v["z"]], 1), dtype=torch.float32, device=device)
        rgb = torch.tensor(np.stack([v["red"], v["green"], v["blue"]], 1) / 255.0, dtype=torch.float32, device=device)
        n = xyz.shape[0]
        dist2 = torch.cdist(xyz, xyz[torch.randperm(n, device=device)[:4096]]).topk(4, largest=False).values[:, 1:]
        scales = torch.log(torch.sqrt(dist2.pow(2).mean(-1).clamp_min(1e-7)))[:, None].repeat(1, 3)
        rots = torch.zeros(n, 4, device=device)
        rots[:, 0] = 1
        feats = torch.zeros(n, 3, (self.max_sh_degree + 1) ** 2, device=device)
        feats[:, :, 0] = (rgb - 0.5) / 0.28209479177387814
        self._xyz = nn.Parameter(xyz)
        self._features_dc = nn.Parameter(feats[:, :, :1].transpose(1, 2).contiguous())
        self._features_rest = nn.Parameter(feats[:, :, 1:].transpose(1, 2).contiguous())
        self._scaling = nn.Parameter(scales)
        self._rotation = nn.Parameter(rots)
        self._opacity = nn.Parameter(inverse_sigmoid(0.1 * torch.ones(n, 1, device=device)))
        self.reset_stats()

    def reset_stats(self):
        n = self._xyz.shape[0]
        dev = self._xyz.device
        self.xyz_gradient_accum = torch.zeros(n, 1, device=dev)
        self.denom = torch.zeros(n, 1, device=dev)
        self.max_radii2D = torch.zeros(n, device=dev)

    def named_tensors(self):
        return {"xyz": self._xyz, "f_dc": self._features_dc, "f_rest": self._features_rest,
                "opacity": self._opacity, "scaling": self._scaling, "rotation": self._rotation}

    def training_setup(self, spatial_lr_scale, batch_size=1):
        # batch_size cameras per step: sqrt lr scaling
        s = math.sqrt(batch_size)
        lrs = {"xyz": 1.6e-4 * spatial_lr_scale, "f_dc": 2.5e-3, "f_rest": 2.5e-3 / 20.0,
               "opacity": 5e-2, "scaling": 5e-3, "rotation": 1e-3}
        self.optimizer = torch.optim.Adam(
            [{"params": [t], "lr": lrs[k] * s, "name": k} for k, t in self.named_tensors().items()], lr=0.0, eps=1e-15)

    def _set(self, tensors):
        self._xyz, self._features_dc, self._features_rest = tensors["xyz"], tensors["f_dc"], tensors["f_rest"]
        self._opacity, self._scaling, self._rotation = tensors["opacity"], tensors["scaling"], tensors["rotation"]

    def _edit_optimizer(self, fn):
        out = {}
        for group in self.optimizer.param_groups:
            old = group["params"][0]
            state = self.optimizer.state.pop(old, None)
            new = nn.Parameter(fn(group["name"], old.data, False))
            if state is not None:
                state["exp_avg"] = fn(group["name"], state["exp_avg"], True)
                state["exp_avg_sq"] = fn(group["name"], state["exp_avg_sq"], True)
                self.optimizer.state[new] = state
            group["params"][0] = new
            out[group["name"]] = new
        self._set(out)

    def prune(self, mask):
        keep = ~mask
        self._edit_optimizer(lambda name, t, is_state: t[keep])
        self.xyz_gradient_accum = self.xyz_gradient_accum[keep]
        self.denom = self.denom[keep]
        self.max_radii2D = self.max_radii2D[keep]

    def append(self, new):
        self._edit_optimizer(lambda name, t, is_state: torch.cat([t, torch.zeros_like(new[name]) if is_state else new[name]]))
        self.reset_stats()

    def densify_and_prune(self, grad_thresh, min_opacity, extent, max_screen_size):
        grads = self.xyz_gradient_accum / self.denom
        grads[grads.isnan()] = 0.0
        scale_max = torch.exp(self._scaling).max(1).values

        clone = (grads.squeeze(-1) >= grad_thresh) & (scale_max <= 0.01 * extent)
        self.append({k: t.data[clone] for k, t in self.named_tensors().items()})

        n = self._xyz.shape[0]
        padded = torch.zeros(n, device=grads.device)
        padded[:grads.shape[0]] = grads.squeeze(-1)
        split = (padded >= grad_thresh) & (torch.exp(self._scaling).max(1).values > 0.01 * extent)
        stds = torch.exp(self._scaling[split]).repeat(2, 1)
        samples = torch.normal(torch.zeros_like(stds), stds)
        rots = build_rotation(self._rotation[split]).repeat(2, 1, 1)
        new = {
            "xyz": (rots @ samples[..., None]).squeeze(-1) + self._xyz[split].repeat(2, 1),
            "scaling": torch.log(torch.exp(self._scaling[split]).repeat(2, 1) / 1.6),
            "rotation": self._rotation[split].repeat(2, 1),
            "f_dc": self._features_dc[split].repeat(2, 1, 1),
            "f_rest": self._features_rest[split].repeat(2, 1, 1),
            "opacity": self._opacity[split].repeat(2, 1),
        }
        self.append({k: v.detach() for k, v in new.items()})
        prune = torch.cat([split, torch.zeros(2 * int(split.sum()), dtype=torch.bool, device=split.device)])
        prune |= (torch.sigmoid(self._opacity) < min_opacity).squeeze(-1)
        if max_screen_size:
            prune |= torch.exp(self._scaling).max(1).values > 0.1 * extent
        self.prune(prune)

    def reset_opacity(self):
        target = inverse_sigmoid(torch.min(torch.sigmoid(self._opacity), torch.ones_like(self._opacity) * 0.01))
        self._edit_optimizer(lambda name, t, is_state:
                             (torch.zeros_like(t) if is_state else target.detach()) if name == "opacity" else t)

    def save_ply(self, path):
        xyz = self._xyz.detach().cpu().numpy()
        attrs = np.concatenate([xyz, np.zeros_like(xyz),
                                self._features_dc.detach().transpose(1, 2).flatten(1).cpu().numpy(),
                                self._features_rest.detach().transpose(1, 2).flatten(1).cpu().numpy(),
                                self._opacity.detach().cpu().numpy(), self._scaling.detach().cpu().numpy(),
                                self._rotation.detach().cpu().numpy()], 1)
        names = ["x", "y", "z", "nx", "ny", "nz"] + [f"f_dc_{i}" for i in range(3)] + \
                [f"f_rest_{i}" for i in range(self._features_rest.shape[1] * 3)] + \
                ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
        el = np.empty(xyz.shape[0], dtype=[(n, "f4") for n in names])
        el[:] = list(map(tuple, attrs))
        PlyData([PlyElement.describe(el, "vertex")]).write(path)


def render(cam, g, bg):
    screenspace = torch.zeros_like(g._xyz, requires_grad=True)
    screenspace.retain_grad()
    settings = GaussianRasterizationSettings(
        image_height=int(cam.H), image_width=int(cam.W),
        tanfovx=math.tan(cam.fovx * 0.5), tanfovy=math.tan(cam.fovy * 0.5), bg=bg, scale_modifier=1.0,
        viewmatrix=cam.world_view, projmatrix=cam.full_proj, sh_degree=g.active_sh_degree,
        campos=cam.center, prefiltered=False, debug=False)
    shs = torch.cat([g._features_dc, g._features_rest], 1)
    out = GaussianRasterizer(raster_settings=settings)(
        means3D=g._xyz, means2D=screenspace, shs=shs, colors_precomp=None,
        opacities=torch.sigmoid(g._opacity), scales=torch.exp(g._scaling),
        rotations=F.normalize(g._rotation, dim=-1), cov3D_precomp=None)
    return out[0], screenspace, out[1]


def training(args):
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    cams = load_cameras(args.source_path, device)
    test_cams = cams[::8]
    train_cams = [c for i, c in enumerate(cams) if i % 8 != 0]
    centers = torch.stack([c.center for c in train_cams])
    extent = (centers - centers.mean(0)).norm(dim=-1).max().item() * 1.1

    g = GaussianModel(args.sh_degree)
    g.create_from_ply(os.path.join(args.source_path, "points3d.ply"), device)
    g.training_setup(extent, batch_size=world)
    bg = torch.tensor([1, 1, 1] if args.white_background else [0, 0, 0], dtype=torch.float32, device=device)
    tb = SummaryWriter(args.model_path) if rank == 0 else None

    order = []
    for it in range(1, args.iterations + 1):
        lr = 1.6e-4 * extent * math.sqrt(world) * (0.01 ** (it / args.iterations))
        g.optimizer.param_groups[0]["lr"] = lr
        if it % 1000 == 0:
            g.active_sh_degree = min(g.active_sh_degree + 1, g.max_sh_degree)
        if not order:
            order = list(range(len(train_cams)))
            random.shuffle(order)
        cam = train_cams[order.pop()]

        image, viewspace, radii = render(cam, g, bg)
        Ll1 = (image - cam.image).abs().mean()
        loss = Ll1
        loss.backward()

        with torch.no_grad():
            for t in g.named_tensors().values():
                dist.all_reduce(t.grad, op=dist.ReduceOp.SUM)
                t.grad /= world

            if it < args.densify_until_iter:
                vis = radii > 0
                g.max_radii2D[vis] = torch.max(g.max_radii2D[vis], radii[vis].float())
                g.xyz_gradient_accum[vis] += torch.norm(viewspace.grad[vis, :2], dim=-1, keepdim=True)
                g.denom[vis] += 1
                if it > args.densify_from_iter and it % args.densification_interval == 0:
                    size_threshold = 20 if it > args.opacity_reset_interval else None
                    g.densify_and_prune(args.densify_grad_threshold, 0.005, extent, size_threshold)
                if it % args.opacity_reset_interval == 0:
                    g.reset_opacity()

            g.optimizer.step()
            g.optimizer.zero_grad(set_to_none=True)

        if rank == 0 and it % 100 == 0:
            tb.add_scalar("train/l1", Ll1.item(), it)
            tb.add_scalar("train/num_gaussians", g._xyz.shape[0], it)

        if it in args.test_iterations:
            with torch.no_grad():
                acc = torch.zeros(2, device=device)
                for c in test_cams[rank::world]:
                    img, _, _ = render(c, g, bg)
                    acc[0] += -10 * torch.log10(F.mse_loss(img.clamp(0, 1), c.image))
                    acc[1] += 1
                dist.all_reduce(acc)
            if rank == 0:
                print(f"[ITER {it}] test PSNR {acc[0].item() / acc[1].item():.2f}  #G {g._xyz.shape[0]}", flush=True)
                tb.add_scalar("test/psnr", acc[0].item() / acc[1].item(), it)

        if it in args.save_iterations and rank == 0:
            out = os.path.join(args.model_path, f"point_cloud/iteration_{it}")
            os.makedirs(out, exist_ok=True)
            g.save_ply(os.path.join(out, "point_cloud.ply"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = ArgumentParser()
    parser.add_argument("-s", "--source_path", required=True)
    parser.add_argument("-m", "--model_path", required=True)
    parser.add_argument("--sh_degree", type=int, default=3)
    parser.add_argument("--white_background", action="store_true")
    parser.add_argument("--iterations", type=int, default=30000)
    parser.add_argument("--densify_from_iter", type=int, default=500)
    parser.add_argument("--densify_until_iter", type=int, default=15000)
    parser.add_argument("--densification_interval", type=int, default=100)
    parser.add_argument("--opacity_reset_interval", type=int, default=3000)
    parser.add_argument("--densify_grad_threshold", type=float, default=2e-4)
    parser.add_argument("--test_iterations", nargs="+", type=int, default=[7000, 30000])
    parser.add_argument("--save_iterations", nargs="+", type=int, default=[7000, 30000])
    args = parser.parse_args()
    os.makedirs(args.model_path, exist_ok=True)
    training(args)
    sys.exit(0)
