"""
Data-parallel 3D Gaussian Splatting.

Every rank holds a full replica of the Gaussians and renders its own training
camera each step. Gradients are averaged by hand (DDP cannot be used because
the number of Gaussians changes during densification), and the densification
statistics are summed over ranks so that every rank makes the same decision.

    torchrun --nproc_per_node=4 gs_dp.py --scene data/mipnerf360/garden --out runs/garden
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from plyfile import PlyData

from gsplat import rasterization
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=30000)
    ap.add_argument("--downscale", type=int, default=4)
    ap.add_argument("--sh_degree", type=int, default=3)
    ap.add_argument("--densify_from", type=int, default=500)
    ap.add_argument("--densify_until", type=int, default=15000)
    ap.add_argument("--densify_every", type=int, default=100)
    ap.add_argument("--grad_thresh", type=float, default=2e-4)
    ap.add_argument("--reset_opacity_every", type=int, default=3000)
    ap.add_argument("--ssim_lambda", type=float, default=0.2)
    ap.add_argument("--test_every", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load_scene(root, downscale, test_every):
    with open(os.path.join(root, "transforms.json")) as f:
        meta = json.load(f)
    frames = sorted(meta["frames"], key=lambda fr: fr["file_path"])
    images, c2ws = [], []
    for fr in frames:
        im = Image.open(os.path.join(root, fr["file_path"]))
        im = im.resize((im.width // downscale, im.height // downscale), Image.LANCZOS)
        images.append(torch.from_numpy(np.asarray(im, dtype=np.float32)[..., :3] / 255.0))
        c2ws.append(torch.tensor(fr["transform_matrix"], dtype=torch.float32))
    images = torch.stack(images)
    c2ws = torch.stack(c2ws)
    c2ws[:, :3, 1:3] *= -1  # OpenGL -> OpenCV
    K = torch.tensor([[meta["fl_x"] / downscale, 0, meta["cx"] / downscale],
                      [0, meta["fl_y"] / downscale, meta["cy"] / downscale],
                      [0, 0, 1]], dtype=torch.float32)
    idx = np.arange(len(frames))
    test_idx = idx[idx % test_every == 0]
    train_idx = idx[idx % test_every != 0]
    ply = PlyData.read(os.path.join(root, "sparse_pc.ply"))["vertex"]
    pts = np.stack([ply["x"], ply["y"], ply["z"]], -1).astype(np.float32)
    cols = np.stack([ply["red"], ply["green"], ply["blue"]], -1).astype(np.float32) / 255.0
    return images, c2ws, K, train_idx, test_idx, torch.from_numpy(pts), torch.from_numpy(cols)


C0 = 0.28209479177387814


def init_gaussians(pts, cols, sh_degree, device):
    n = pts.shape[0]
    d2 = torch.cdist(pts[:1024], pts).topk(4, largest=False).values[:, 1:].pow(2).mean(-1)
    scale = torch.sqrt(d2.mean()).clamp_min(1e-4).log()
    params = {
        "means": pts.clone(),
        "scales": torch.full((n, 3), float(scale)),
        "quats": F.normalize(torch.randn(n, 4), dim=-1),
        "opacities": torch.logit(torch.full((n,), 0.1)),
        "sh0": ((cols - 0.5) / C0)[:, None, :],
        "shN": torch.zeros(n, (sh_degree + 1) ** 2 - 1, 3),
    }
    return {k: torch.nn.Parameter(v.to(device)) for k, v in params.items()}


LRS = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}


def make_optimizers(params, scene_scale, n_cams):
    # n_cams views per step (one per rank): sqrt learning-rate scaling and matching Adam betas
    s = math.sqrt(n_cams)
    betas = (0.9 ** n_cams, 0.999 ** n_cams)
    return {k: torch.optim.Adam([params[k]], lr=LRS[k] * s * (scene_scale if k == "means" else 1.0),
                                betas=betas, eps=1e-15)
            for k in params}


def replace_param(params, optims, name, new_value, keep_mask=None, n_new=0):
    """Swap in a resized tensor and resize the matching Adam moments."""
    opt = optims[name]
    old = params[name]
    state = opt.state.pop(old, None)
    p = torch.nn.Parameter(new_value)
    opt.param_groups[0]["params"] = [p]
    if state is not None:
        for key in ("exp_avg", "exp_avg_sq"):
            v = state[key]
            if keep_mask is not None:
                v = v[keep_mask]
            if n_new:
                v = torch.cat([v, torch.zeros((n_new, *v.shape[1:]), device=v.device)])
            state[key] = v
        opt.state[p] = state
    params[name] = p


@torch.no_grad()
def densify_and_prune(params, optims, grad2d, count, step, args, scene_scale, gen):
    avg = grad2d / count.clamp_min(1)
    big = avg > args.grad_thresh
    large = params["scales"].exp().max(-1).values > 0.01 * scene_scale
    clone = big & ~large
    split = big & large

    # clone: duplicate in place
    for k in list(params):
        v = params[k].data
        replace_param(params, optims, k, torch.cat([v, v[clone]]), n_new=int(clone.sum()))
    split = torch.cat([split, torch.zeros(int(clone.sum()), dtype=torch.bool, device=split.device)])

    # split: two children sampled inside the parent, parent removed
    n_split = int(split.sum())
    if n_split:
        scales = params["scales"].data[split].exp()
        q = F.normalize(params["quats"].data[split], dim=-1)
        w, x, y, z = q.unbind(-1)
        R = torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                         2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                         2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).view(-1, 3, 3)
        offs = torch.randn(2, n_split, 3, device=scales.device, generator=gen) * scales
        new_means = (R[None] @ offs[..., None]).squeeze(-1) + params["means"].data[split][None]
        keep = ~split
        new_vals = {
            "means": new_means.reshape(-1, 3),
            "scales": (scales / 1.6).log().repeat(2, 1),
        }
        for k in list(params):
            v = params[k].data
            child = new_vals.get(k, v[split].repeat(2, *([1] * (v.dim() - 1))))
            replace_param(params, optims, k, torch.cat([v[keep], child]), keep_mask=keep, n_new=2 * n_split)

    # prune transparent / huge
    prune = torch.sigmoid(params["opacities"].data) < 0.005
    if step > args.reset_opacity_every:
        prune |= params["scales"].data.exp().max(-1).values > 0.1 * scene_scale
    if prune.any():
        keep = ~prune
        for k in list(params):
            replace_param(params, optims, k, params[k].data[keep], keep_mask=keep)


def render(params, c2w, K, W, H, sh_degree, device):
    viewmat = torch.linalg.inv(c2w.to(device))[None]
    colors = torch.cat([params["sh0"], params["shN"]], 1)
    img, alpha, info = rasterization(
        means=params["means"], quats=params["quats"], scales=params["scales"].exp(),
        opacities=torch.sigmoid(params["opacities"]), colors=colors,
        viewmats=viewmat, Ks=K.to(device)[None], width=W, height=H, sh_degree=sh_degree,
        packed=False,
    )
    return img[0].clamp(0, 1), info


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    torch.manual_seed(args.seed)  # identical initial Gaussians on every rank
    densify_gen = torch.Generator(device=device).manual_seed(args.seed)  # shared: same splits everywhere
    cam_rng = np.random.default_rng(args.seed + rank)  # per-rank: different views per step

    images, c2ws, K, train_idx, test_idx, pts, cols = load_scene(args.scene, args.downscale, args.test_every)
    H, W = images.shape[1:3]
    scene_scale = float((c2ws[:, :3, 3] - c2ws[:, :3, 3].mean(0)).norm(dim=-1).max()) * 1.1
    params = init_gaussians(pts, cols, args.sh_degree, device)
    optims = make_optimizers(params, scene_scale, world)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_idx)} train / {len(test_idx)} test views, {pts.shape[0]} init points, {world} ranks")

    grad2d = torch.zeros(params["means"].shape[0], device=device)
    count = torch.zeros_like(grad2d)
    t0 = time.time()
    for step in range(1, args.iters + 1):
        cam = int(cam_rng.choice(train_idx))
        gt = images[cam].to(device, non_blocking=True)
        sh_deg = min(step // 1000, args.sh_degree)
        pred, info = render(params, c2ws[cam], K, W, H, sh_deg, device)
        info["means2d"].retain_grad()
        l1 = (pred - gt).abs().mean()
        ssim_loss = 1.0 - ssim_fn(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0)
        loss = (1 - args.ssim_lambda) * l1 + args.ssim_lambda * ssim_loss
        loss.backward()

        grads = [params[k].grad for k in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

        if step < args.densify_until:
            with torch.no_grad():
                g2 = info["means2d"].grad[0].clone()
                g2[..., 0] *= W / 2.0
                g2[..., 1] *= H / 2.0
                radii = info["radii"][0]
                vis = (radii > 0).all(-1) if radii.dim() == 2 else radii > 0
                grad2d[vis] += g2[vis].norm(dim=-1)
                count[vis] += 1

        for opt in optims.values():
            opt.step()
            opt.zero_grad(set_to_none=True)

        if args.densify_from < step < args.densify_until and step % args.densify_every == 0:
            dist.all_reduce(grad2d, op=dist.ReduceOp.SUM)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
            densify_and_prune(params, optims, grad2d, count, step, args, scene_scale, densify_gen)
            grad2d = torch.zeros(params["means"].shape[0], device=device)
            count = torch.zeros_like(grad2d)
            torch.cuda.empty_cache()

        if step % args.reset_opacity_every == 0 and step < args.densify_until:
            new_op = torch.minimum(params["opacities"].data, torch.logit(torch.tensor(0.01, device=device)))
            replace_param(params, optims, "opacities", new_op)

        if rank == 0 and step % 500 == 0:
            print(f"step {step} loss {loss.item():.4f} #G {params['means'].shape[0]} "
                  f"{(time.time() - t0) / step:.3f}s/it", flush=True)

    # held-out evaluation: views split over ranks, sums reduced
    stats = torch.zeros(3, device=device)
    with torch.no_grad():
        for cam in test_idx[rank::world]:
            gt = images[cam].to(device)
            pred, _ = render(params, c2ws[cam], K, W, H, args.sh_degree, device)
            mse = F.mse_loss(pred, gt)
            stats[0] += -10.0 * torch.log10(mse)
            stats[1] += ssim_fn(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0)
            stats[2] += 1
    dist.all_reduce(stats)
    if rank == 0:
        n = stats[2].item()
        print(f"test PSNR {stats[0].item() / n:.3f}  SSIM {stats[1].item() / n:.4f}  ({int(n)} views)")
        torch.save({k: v.detach().cpu() for k, v in params.items()}, os.path.join(args.out, "gaussians.pt"))
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"psnr": stats[0].item() / n, "ssim": stats[1].item() / n, "num_gaussians":
                       params["means"].shape[0]}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
