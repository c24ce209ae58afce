"""3D Gaussian Splatting, one camera per GPU per step, gradients averaged across GPUs.

Every rank keeps a full replica of the Gaussians; each step rank r renders a different
training view, gradients are all-reduced and every rank takes the same Adam step.

    torchrun --standalone --nproc_per_node=8 02_gs_densify.py --scene data/mipnerf360/garden --out out/garden
"""
import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gsplat import rasterization
from PIL import Image
from plyfile import PlyData
from simple_knn._C import distCUDA2
from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=30_000)
    ap.add_argument("--downscale", type=int, default=4)
    ap.add_argument("--sh_degree", type=int, default=3)
    ap.add_argument("--densify_from", type=int, default=500)
    ap.add_argument("--densify_until", type=int, default=15_000)
    ap.add_argument("--densify_every", type=int, default=100)
    ap.add_argument("--opacity_reset_every", type=int, default=3000)
    ap.add_argument("--grad_thresh", type=float, default=2e-4)
    ap.add_argument("--percent_dense", type=float, default=0.01)
    ap.add_argument("--lambda_dssim", type=float, default=0.2)
    ap.add_argument("--test_every", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def load_scene(root, downscale, device):
    with open(os.path.join(root, "transforms.json")) as f:
        meta = json.load(f)
    cams = []
    for fr in sorted(meta["frames"], key=lambda x: x["file_path"]):
        img = Image.open(os.path.join(root, fr["file_path"]))
        w, h = img.size[0] // downscale, img.size[1] // downscale
        img = torch.from_numpy(np.asarray(img.resize((w, h), Image.LANCZOS), dtype=np.float32) / 255.0)[..., :3]
        c2w = torch.tensor(fr["transform_matrix"], dtype=torch.float32)
        c2w[:3, 1:3] *= -1  # OpenGL -> OpenCV
        K = torch.tensor([[meta["fl_x"] / downscale, 0, meta["cx"] / downscale],
                          [0, meta["fl_y"] / downscale, meta["cy"] / downscale], [0, 0, 1]], dtype=torch.float32)
        cams.append({"image": img.to(device), "viewmat": torch.linalg.inv(c2w).to(device), "K": K.to(device),
                     "w": w, "h": h, "center": c2w[:3, 3]})
    ply = PlyData.read(os.path.join(root, "sparse_pc.ply"))["vertex"]
    xyz = np.stack([ply["x"], ply["y"], ply["z"]], -1).astype(np.float32)
    rgb = np.stack([ply["red"], ply["green"], ply["blue"]], -1).astype(np.float32) / 255.0
    centers = torch.stack([c["center"] for c in cams])
    extent = (centers - centers.mean(0)).norm(dim=-1).max().item() * 1.1
    return cams, torch.from_numpy(xyz), torch.from_numpy(rgb), extent


def quat_to_rotmat(q):
    q = F.normalize(q, dim=-1)
    w, x, y, z = q.unbind(-1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).view(*q.shape[:-1], 3, 3)


def ssim(a, b, win=11):
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    g = torch.exp(-((torch.arange(win, device=a.device) - win // 2) ** 2) / (2 * 1.5 ** 2))
    g = (g / g.sum())
    k = (g[:, None] * g[None]).expand(3, 1, win, win)
    mu_a, mu_b = F.conv2d(a, k, padding=win // 2, groups=3), F.conv2d(b, k, padding=win // 2, groups=3)
    s_aa = F.conv2d(a * a, k, padding=win // 2, groups=3) - mu_a ** 2
    s_bb = F.conv2d(b * b, k, padding=win // 2, groups=3) - mu_b ** 2
    s_ab = F.conv2d(a * b, k, padding=win // 2, groups=3) - mu_a * mu_b
    return (((2 * mu_a * mu_b + c1) * (2 * s_ab + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (s_aa + s_bb + c2))).mean()


class Gaussians:
    NAMES = ("means", "scales", "quats", "opacities", "sh0", "shN")

    def __init__(self, xyz, rgb, sh_degree, extent, device, lr_scale=1.0):
        n = xyz.shape[0]
        xyz = xyz.to(device)
        dist2 = distCUDA2(xyz).clamp_min(1e-7)
        sh0 = ((rgb - 0.5) / 0.28209479177387814)[:, None].to(device)
        self.params = {
            "means": xyz,
            "scales": torch.log(torch.sqrt(dist2))[:, None].repeat(1, 3),
            "quats": torch.tensor([1.0, 0, 0, 0], device=device).repeat(n, 1),
            "opacities": torch.logit(torch.full((n,), 0.1, device=device)),
            "sh0": sh0,
            "shN": torch.zeros(n, (sh_degree + 1) ** 2 - 1, 3, device=device),
        }
        for k in self.NAMES:
            self.params[k] = torch.nn.Parameter(self.params[k].contiguous())
        lrs = {"means": 1.6e-4 * extent, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}
        lrs = {k: v * lr_scale for k, v in lrs.items()}
        self.optim = torch.optim.Adam([{"params": [self.params[k]], "lr": lrs[k], "name": k} for k in self.NAMES], eps=1e-15)
        self.means_lr0 = lrs["means"]
        self.reset_stats()

    def __getitem__(self, k):
        return self.params[k]

    def __len__(self):
        return self.params["means"].shape[0]

    def reset_stats(self):
        dev = self.params["means"].device
        self.grad_accum = torch.zeros(len(self), device=dev)
        self.count = torch.zeros(len(self), device=dev)

    def _replace(self, name, value, state_fn):
        group = next(gr for gr in self.optim.param_groups if gr["name"] == name)
        old = group["params"][0]
        new = torch.nn.Parameter(value.contiguous())
        st = self.optim.state.pop(old, None)
        if st is not None:
            st["exp_avg"], st["exp_avg_sq"] = state_fn(st["exp_avg"]), state_fn(st["exp_avg_sq"])
            self.optim.state[new] = st
        group["params"][0] = new
        self.params[name] = new

    def extend(self, extra):
        for k in self.NAMES:
            add = extra[k]
            self._replace(k, torch.cat([self.params[k].data, add]),
                          lambda s, add=add: torch.cat([s, torch.zeros_like(add)]))

    def prune(self, keep):
        for k in self.NAMES:
            self._replace(k, self.params[k].data[keep], lambda s: s[keep])

    @torch.no_grad()
    def densify_and_prune(self, grad_thresh, scene_extent, percent_dense, gen):
        avg = self.grad_accum / self.count.clamp_min(1)
        high = avg >= grad_thresh
        big = self["scales"].exp().max(-1).values > percent_dense * scene_extent
        clone, split = high & ~big, high & big
        p = self.params
        extra = {k: p[k][clone] for k in self.NAMES}
        # split: two samples inside each large Gaussian, scales shrunk by 1.6
        n_split = int(split.sum())
        std = p["scales"][split].exp().repeat(2, 1)
        noise = torch.randn((2 * n_split, 3), device=std.device, generator=gen) * std
        rot = quat_to_rotmat(p["quats"][split]).repeat(2, 1, 1)
        split_new = {
            "means": (rot @ noise[..., None]).squeeze(-1) + p["means"][split].repeat(2, 1),
            "scales": torch.log(p["scales"][split].exp() / 1.6).repeat(2, 1),
            "quats": p["quats"][split].repeat(2, 1),
            "opacities": p["opacities"][split].repeat(2),
            "sh0": p["sh0"][split].repeat(2, 1, 1),
            "shN": p["shN"][split].repeat(2, 1, 1),
        }
        self.extend({k: torch.cat([extra[k], split_new[k]]) for k in self.NAMES})
        n_added = len(self) - avg.shape[0]
        keep = torch.cat([~split, torch.ones(n_added, dtype=torch.bool, device=avg.device)])
        keep &= torch.sigmoid(self["opacities"]) > 0.005
        keep &= self["scales"].exp().max(-1).values < 0.1 * scene_extent
        self.prune(keep)
        self.reset_stats()

    @torch.no_grad()
    def reset_opacity(self):
        self._replace("opacities", self["opacities"].data.clamp(max=math.log(0.01 / 0.99)), torch.zeros_like)


def render(g, cam, sh_degree):
    colors = torch.cat([g["sh0"], g["shN"]], 1)
    out, alpha, info = rasterization(g["means"], g["quats"], g["scales"].exp(), torch.sigmoid(g["opacities"]), colors,
                                     cam["viewmat"][None], cam["K"][None], cam["w"], cam["h"], sh_degree=sh_degree,
                                     backgrounds=torch.zeros(1, 3, device=g["means"].device))
    return out[0].clamp(0, 1), info


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)  # identical init and split noise on every rank
    gen = torch.Generator(device=device).manual_seed(args.seed)

    cams, xyz, rgb, extent = load_scene(args.scene, args.downscale, device)
    test_cams = [c for i, c in enumerate(cams) if i % args.test_every == 0]
    train_cams = [c for i, c in enumerate(cams) if i % args.test_every != 0]
    # one view per GPU per step: sqrt(batch) lr scaling as in Grendel-GS
    g = Gaussians(xyz, rgb, args.sh_degree, extent, device, lr_scale=math.sqrt(world))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_cams)} train / {len(test_cams)} test views, {len(g)} initial Gaussians, extent {extent:.2f}")

    order_gen = torch.Generator().manual_seed(args.seed)
    order = []
    for it in range(1, args.iterations + 1):
        if len(order) < world:
            order += torch.randperm(len(train_cams), generator=order_gen).tolist()
        cam = train_cams[order[rank]]
        order = order[world:]

        frac = it / args.iterations
        for group in g.optim.param_groups:
            if group["name"] == "means":
                group["lr"] = math.exp((1 - frac) * math.log(g.means_lr0) + frac * math.log(g.means_lr0 * 0.01))
        sh_deg = min(it // 1000, args.sh_degree)

        img, info = render(g, cam, sh_deg)
        info["means2d"].retain_grad()
        gt = cam["image"]
        l1 = (img - gt).abs().mean()
        loss = (1 - args.lambda_dssim) * l1 + args.lambda_dssim * (1 - ssim(img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]))
        loss.backward()

        for k in Gaussians.NAMES:
            dist.all_reduce(g[k].grad, op=dist.ReduceOp.AVG)

        with torch.no_grad():
            if it < args.densify_until:
                grad2d = info["means2d"].grad[0].clone()
                grad2d[..., 0] *= cam["w"] / 2.0
                grad2d[..., 1] *= cam["h"] / 2.0
                vis = info["radii"][0] > 0
                if vis.dim() == 2:
                    vis = vis.all(-1)
                g.grad_accum[vis] += grad2d[vis].norm(dim=-1)
                g.count[vis] += 1

        g.optim.step()
        g.optim.zero_grad(set_to_none=True)

        if args.densify_from < it < args.densify_until and it % args.densify_every == 0:
            g.densify_and_prune(args.grad_thresh, extent, args.percent_dense, gen)
        if it < args.densify_until and it % args.opacity_reset_every == 0:
            g.reset_opacity()

        if it % 100 == 0:
            stat = torch.tensor([loss.item(), float(len(g))], device=device)
            dist.all_reduce(stat, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"it {it:6d}  loss {stat[0]:.4f}  #gs {int(stat[1])}", flush=True)

        if it in (7000, args.iterations):
            evaluate(g, test_cams, args, rank, world, device, it)

    if rank == 0:
        torch.save({k: g[k].detach().cpu() for k in Gaussians.NAMES}, os.path.join(args.out, "gaussians.pt"))
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(g, test_cams, args, rank, world, device, it):
    lp = LearnedPerceptualImagePatchSimilarity(net_type="vgg", normalize=True).to(device)
    sums = torch.zeros(3, device=device)
    for cam in test_cams[rank::world]:
        img, _ = render(g, cam, args.sh_degree)
        mse = F.mse_loss(img, cam["image"])
        sums[0] += -10 * torch.log10(mse)
        sums[1] += lp(img.permute(2, 0, 1)[None], cam["image"].permute(2, 0, 1)[None])
        sums[2] += 1
    dist.all_reduce(sums)
    if rank == 0:
        print(f"[eval @ {it}] PSNR {sums[0] / sums[2]:.3f}  LPIPS {sums[1] / sums[2]:.4f}  #gs {len(g)}", flush=True)


if __name__ == "__main__":
    main()
