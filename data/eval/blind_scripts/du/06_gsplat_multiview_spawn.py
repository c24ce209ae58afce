"""3D Gaussian Splatting with the camera batch spread over GPUs.

Every process holds the full set of Gaussians, renders its own training view,
and gradients are averaged with all_reduce before the (identical) Adam step.
Densification uses the all-reduced screen-space statistics and a generator
seeded the same way on every rank, so the Gaussians stay identical everywhere.

    python 06_gsplat_multiview_spawn.py --scene /data/mipnerf360/bicycle --gpus 4
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
import torch.nn.functional as F
from gsplat import rasterization
from plyfile import PlyData
from pytorch_msssim import ssim


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--out", default="output/gs")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=str, default="29511")
    p.add_argument("--iters", type=int, default=30000)
    p.add_argument("--sh_degree", type=int, default=3)
    p.add_argument("--ssim_lambda", type=float, default=0.2)
    p.add_argument("--densify_from", type=int, default=500)
    p.add_argument("--densify_until", type=int, default=15000)
    p.add_argument("--densify_every", type=int, default=100)
    p.add_argument("--grad_thresh", type=float, default=2e-4)
    p.add_argument("--reset_every", type=int, default=3000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def load_scene(root):
    with open(os.path.join(root, "transforms.json")) as f:
        meta = json.load(f)
    cams = []
    for fr in meta["frames"]:
        c2w = np.array(fr["transform_matrix"], dtype=np.float32) @ np.diag([1, -1, -1, 1]).astype(np.float32)
        K = np.array([[meta["fl_x"], 0, meta["cx"]], [0, meta["fl_y"], meta["cy"]], [0, 0, 1]], dtype=np.float32)
        cams.append((os.path.join(root, fr["file_path"]), np.linalg.inv(c2w), K))
    ply = PlyData.read(os.path.join(root, meta["ply_file_path"]))["vertex"]
    xyz = np.stack([ply["x"], ply["y"], ply["z"]], -1).astype(np.float32)
    rgb = np.stack([ply["red"], ply["green"], ply["blue"]], -1).astype(np.float32) / 255.0
    return cams, xyz, rgb


def init_gaussians(xyz, rgb, sh_degree, device):
    pts = torch.from_numpy(xyz).to(device)
    # mean distance to the 3 nearest neighbours (chunked to bound memory)
    d = torch.cat([torch.cdist(pts[s:s + 4096], pts).topk(4, largest=False).values[:, 1:]
                   for s in range(0, pts.shape[0], 4096)])
    n = pts.shape[0]
    params = {
        "means": pts,
        "scales": torch.log(d.mean(-1, keepdim=True).clamp_min(1e-7)).repeat(1, 3),
        "quats": torch.tensor([1.0, 0, 0, 0], device=device).repeat(n, 1),
        "opacities": torch.logit(torch.full((n,), 0.1, device=device)),
        "sh0": ((torch.from_numpy(rgb).to(device) - 0.5) / 0.28209479177387814)[:, None],
        "shN": torch.zeros(n, (sh_degree + 1) ** 2 - 1, 3, device=device),
    }
    return {k: torch.nn.Parameter(v.contiguous()) for k, v in params.items()}


LRS = {"means": 1.6e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}


def make_optim(params, scene_scale):
    return torch.optim.Adam([{"params": [p], "lr": LRS[k] * (scene_scale if k == "means" else 1.0), "name": k}
                             for k, p in params.items()], eps=1e-15)


def update_params(params, optim, fn):
    """Apply fn (select / extend rows) to every parameter and its Adam state."""
    for group in optim.param_groups:
        old = group["params"][0]
        new = torch.nn.Parameter(fn(old.data, group["name"], is_state=False))
        state = optim.state.pop(old, None)
        if state is not None:
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = fn(state[key], group["name"], is_state=True)
            optim.state[new] = state
        group["params"][0] = new
        params[group["name"]] = new


def quat_to_rot(q):
    w, x, y, z = F.normalize(q, dim=-1).unbind(-1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).view(-1, 3, 3)


def densify_and_prune(params, optim, grad2d, count, scene_scale, gen, args):
    avg = grad2d / count.clamp_min(1)
    big = avg >= args.grad_thresh
    scale_max = torch.exp(params["scales"]).max(-1).values
    clone = big & (scale_max <= 0.01 * scene_scale)
    split = big & (scale_max > 0.01 * scene_scale)
    n_split = int(split.sum())
    # two children per split Gaussian, sampled from its covariance
    samples = torch.randn(2, n_split, 3, device=grad2d.device, generator=gen)
    scales_s = torch.exp(params["scales"][split])
    R = quat_to_rot(params["quats"][split])
    offsets = (R @ (samples * scales_s)[..., None]).squeeze(-1)

    def extend(t, name, is_state):
        if is_state:
            return torch.cat([t, t[clone], t[split].repeat(2, *[1] * (t.dim() - 1))])
        if name == "means":
            return torch.cat([t, t[clone], (t[split] + offsets).reshape(-1, 3)])
        if name == "scales":
            return torch.cat([t, t[clone], torch.log(scales_s / 1.6).repeat(2, 1)])
        return torch.cat([t, t[clone], t[split].repeat(2, *[1] * (t.dim() - 1))])

    update_params(params, optim, extend)
    n_old = split.shape[0]
    drop = torch.cat([split, torch.zeros(int(clone.sum()) + 2 * n_split, dtype=torch.bool, device=split.device)])
    drop |= torch.sigmoid(params["opacities"]) < 0.005
    update_params(params, optim, lambda t, name, is_state: t[~drop])
    return n_old, params["means"].shape[0]


def run(rank, world, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)

    cams, xyz, rgb = load_scene(args.scene)
    test_ids = list(range(0, len(cams), 8))
    train_ids = [i for i in range(len(cams)) if i % 8 != 0]
    images = {i: torch.from_numpy(imageio.imread(cams[i][0])[..., :3].astype(np.float32) / 255.0) for i in range(len(cams))}
    cam_centers = np.stack([np.linalg.inv(c[1])[:3, 3] for c in cams])
    scene_scale = float(np.linalg.norm(cam_centers - cam_centers.mean(0), axis=1).max() * 1.1)

    params = init_gaussians(xyz, rgb, args.sh_degree, dev)
    for p in params.values():
        dist.broadcast(p.data, src=0)
    optim = make_optim(params, scene_scale)
    gen = torch.Generator(device=dev).manual_seed(args.seed)  # same stream on every rank
    perm_gen = torch.Generator().manual_seed(args.seed)
    grad2d = torch.zeros(params["means"].shape[0], device=dev)
    count = torch.zeros_like(grad2d)

    # schedules are given in images seen, as in single-GPU 3DGS; one step consumes `world` images
    steps = args.iters // world
    densify_from, densify_until = args.densify_from // world, args.densify_until // world
    densify_every, reset_every = max(1, args.densify_every // world), args.reset_every // world
    sh_every = max(1, 1000 // world)

    order = []
    for step in range(steps):
        if len(order) < world:
            order += torch.randperm(len(train_ids), generator=perm_gen).tolist()
        batch, order = order[:world], order[world:]
        cid = train_ids[batch[rank]]
        viewmat = torch.from_numpy(cams[cid][1]).to(dev)[None]
        K = torch.from_numpy(cams[cid][2]).to(dev)[None]
        gt = images[cid].to(dev, non_blocking=True)
        H, W = gt.shape[:2]

        colors = torch.cat([params["sh0"], params["shN"]], 1)
        render, alpha, meta = rasterization(
            params["means"], F.normalize(params["quats"], dim=-1), torch.exp(params["scales"]),
            torch.sigmoid(params["opacities"]), colors, viewmat, K, W, H,
            sh_degree=min(step // sh_every, args.sh_degree), packed=False)
        meta["means2d"].retain_grad()
        img = render[0]
        loss = (1 - args.ssim_lambda) * F.l1_loss(img, gt) + args.ssim_lambda * (
            1 - ssim(img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0, size_average=True))
        loss.backward()

        for p in params.values():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)

        if step < densify_until:
            g = meta["means2d"].grad[0].clone()
            g[..., 0] *= W / 2.0
            g[..., 1] *= H / 2.0
            radii = meta["radii"][0]
            vis = (radii > 0).all(-1) if radii.dim() == 2 else radii > 0
            grad2d[vis] += g[vis].norm(dim=-1)
            count[vis] += 1

        optim.step()
        optim.zero_grad(set_to_none=True)

        if densify_from <= step < densify_until and (step + 1) % densify_every == 0:
            dist.all_reduce(grad2d)
            dist.all_reduce(count)
            n_before, n_after = densify_and_prune(params, optim, grad2d, count, scene_scale, gen, args)
            grad2d = torch.zeros(n_after, device=dev)
            count = torch.zeros_like(grad2d)
            if rank == 0 and (step + 1) % (10 * densify_every) == 0:
                print(f"[{step + 1}] gaussians {n_before} -> {n_after}", flush=True)
        if (step + 1) % reset_every == 0 and step < densify_until:
            update_params(params, optim, lambda t, name, is_state:
                          (torch.zeros_like(t) if is_state else t.clamp_max(torch.logit(torch.tensor(0.01)).item()))
                          if name == "opacities" else t)

        if (step + 1) % 100 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step + 1} loss {l.item():.4f} N={params['means'].shape[0]}", flush=True)

    # evaluation on held-out views, split over ranks
    sums = torch.zeros(3, device=dev)
    with torch.no_grad():
        colors = torch.cat([params["sh0"], params["shN"]], 1)
        for cid in test_ids[rank::world]:
            gt = images[cid].to(dev)
            H, W = gt.shape[:2]
            img = rasterization(params["means"], F.normalize(params["quats"], dim=-1), torch.exp(params["scales"]),
                                torch.sigmoid(params["opacities"]), colors,
                                torch.from_numpy(cams[cid][1]).to(dev)[None], torch.from_numpy(cams[cid][2]).to(dev)[None],
                                W, H, sh_degree=args.sh_degree)[0][0].clamp(0, 1)
            sums[0] += -10 * torch.log10(F.mse_loss(img, gt))
            sums[1] += ssim(img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0)
            sums[2] += 1
    dist.all_reduce(sums)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"test PSNR {sums[0].item() / sums[2].item():.2f}  SSIM {sums[1].item() / sums[2].item():.4f}")
        torch.save({k: v.detach().cpu() for k, v in params.items()}, os.path.join(args.out, "gaussians.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    mp.spawn(run, args=(args.gpus, args), nprocs=args.gpus, join=True)
