"""Data-parallel Gaussian Splatting with gsplat, launched with torch.multiprocessing.spawn.

Every process holds the full set of Gaussians and renders a different training view each
step; gradients and densification statistics are summed across processes so that every
replica applies the same update and densifies the same Gaussians.

    python 09_gs_spawn.py --data data/tandt/truck --result results/truck --gpus 4
"""
import argparse
import json
import math
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from gsplat import rasterization
from PIL import Image
from plyfile import PlyData
from simple_knn._C import distCUDA2
from torchmetrics.image import PeakSignalNoiseRatio
from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--steps", type=int, default=30_000)
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--refine_start", type=int, default=500)
    p.add_argument("--refine_stop", type=int, default=15_000)
    p.add_argument("--refine_every", type=int, default=100)
    p.add_argument("--reset_every", type=int, default=3000)
    p.add_argument("--grow_grad2d", type=float, default=2e-4)
    p.add_argument("--grow_scale3d", type=float, default=0.01)
    p.add_argument("--prune_opa", type=float, default=0.005)
    p.add_argument("--ssim_lambda", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def load_views(root, factor):
    meta = json.load(open(os.path.join(root, "transforms.json")))
    views = []
    for fr in sorted(meta["frames"], key=lambda f: f["file_path"]):
        im = Image.open(os.path.join(root, fr["file_path"])).convert("RGB")
        im = im.resize((im.width // factor, im.height // factor), Image.BICUBIC)
        c2w = np.array(fr["transform_matrix"], dtype=np.float32)
        c2w[:3, 1:3] *= -1
        K = np.array([[fr.get("fl_x", meta.get("fl_x")) / factor, 0, fr.get("cx", meta.get("cx")) / factor],
                      [0, fr.get("fl_y", meta.get("fl_y")) / factor, fr.get("cy", meta.get("cy")) / factor],
                      [0, 0, 1]], dtype=np.float32)
        views.append(dict(img=torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0),
                          viewmat=torch.from_numpy(np.linalg.inv(c2w)), K=torch.from_numpy(K), c2w=c2w))
    ply = PlyData.read(os.path.join(root, "points3D.ply"))["vertex"]
    pts = np.stack([ply["x"], ply["y"], ply["z"]], 1).astype(np.float32)
    cols = np.stack([ply["red"], ply["green"], ply["blue"]], 1).astype(np.float32) / 255.0
    return views, torch.from_numpy(pts), torch.from_numpy(cols)


def init_gaussians(pts, cols, device):
    pts, cols = pts.to(device), cols.to(device)
    nn3 = torch.sqrt(distCUDA2(pts).clamp_min(1e-7))  # mean distance to the 3 nearest neighbours
    n = pts.shape[0]
    return {
        "means": pts, "scales": torch.log(nn3)[:, None].repeat(1, 3),
        "quats": F.normalize(torch.rand(n, 4, device=device), dim=-1),
        "opacities": torch.logit(torch.full((n,), 0.1, device=device)),
        "sh0": ((cols - 0.5) / 0.28209479177387814)[:, None], "shN": torch.zeros(n, 15, 3, device=device),
    }


def make_optimizers(params, lrs):
    return {k: torch.optim.Adam([{"params": [params[k]], "lr": lrs[k]}], eps=1e-15) for k in params}


def update_params(params, optims, fn_param, fn_state):
    for k in list(params.keys()):
        old = params[k]
        new = torch.nn.Parameter(fn_param(k, old.data))
        opt = optims[k]
        st = opt.state.pop(old, {})
        for sk in ("exp_avg", "exp_avg_sq"):
            if sk in st:
                st[sk] = fn_state(st[sk])
        opt.param_groups[0]["params"] = [new]
        opt.state[new] = st
        params[k] = new


@torch.no_grad()
def refine(params, optims, grad2d, count, cfg, extent, gen):
    avg = grad2d / count.clamp_min(1)
    grow = avg > cfg.grow_grad2d
    small = params["scales"].exp().max(-1).values <= cfg.grow_scale3d * extent
    dup, split = grow & small, grow & ~small
    n_dup, n_split = int(dup.sum()), int(split.sum())
    if n_dup:
        update_params(params, optims, lambda k, t: torch.cat([t, t[dup]]),
                      lambda s: torch.cat([s, torch.zeros_like(s[:n_dup])]))
        split = torch.cat([split, torch.zeros(n_dup, dtype=torch.bool, device=split.device)])
    if n_split:
        scales = params["scales"][split].exp()
        q = F.normalize(params["quats"][split], dim=-1)
        w, x, y, z = q.unbind(-1)
        R = torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                         2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                         2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).view(-1, 3, 3)
        offs = torch.einsum("nij,bnj->bni", R, torch.randn(2, n_split, 3, device=scales.device, generator=gen) * scales)

        def split_fn(k, t):
            rest = t[~split]
            if k == "means":
                add = (t[split][None] + offs).reshape(-1, 3)
            elif k == "scales":
                add = torch.log(scales / 1.6).repeat(2, 1)
            else:
                add = t[split].repeat(2, *[1] * (t.dim() - 1))
            return torch.cat([rest, add])

        update_params(params, optims, split_fn, lambda s: torch.cat([s[~split], torch.zeros_like(s[split]).repeat(2, *[1] * (s.dim() - 1))]))
    prune = torch.sigmoid(params["opacities"]) < cfg.prune_opa
    prune |= params["scales"].exp().max(-1).values > 0.1 * extent
    if prune.any():
        update_params(params, optims, lambda k, t: t[~prune], lambda s: s[~prune])
    return n_dup, n_split, int(prune.sum())


def rasterize(params, view, sh_degree, device):
    img, _, info = rasterization(params["means"], params["quats"], params["scales"].exp(), torch.sigmoid(params["opacities"]),
                                 torch.cat([params["sh0"], params["shN"]], 1), view["viewmat"][None].to(device),
                                 view["K"][None].to(device), view["img"].shape[1], view["img"].shape[0], sh_degree=sh_degree)
    return img[0], info


def worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    views, pts, cols = load_views(cfg.data, cfg.factor)
    test = views[::8]
    train = [v for i, v in enumerate(views) if i % 8]
    centers = np.stack([v["c2w"][:3, 3] for v in train])
    extent = float(np.linalg.norm(centers - centers.mean(0), axis=1).max()) * 1.1

    torch.manual_seed(cfg.seed)
    params = {k: torch.nn.Parameter(v.contiguous()) for k, v in init_gaussians(pts, cols, device).items()}
    for v in params.values():
        dist.broadcast(v.data, src=0)
    lrs = {"means": 1.6e-4 * extent, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}
    # a step averages world_size views: sqrt(batch) learning-rate scaling
    lrs = {k: v * math.sqrt(world_size) for k, v in lrs.items()}
    optims = make_optimizers(params, lrs)
    means_decay = 0.01 ** (1.0 / cfg.steps)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    view_rng = np.random.default_rng(cfg.seed)

    grad2d = torch.zeros(params["means"].shape[0], device=device)
    count = torch.zeros_like(grad2d)
    for step in range(cfg.steps):
        order = view_rng.permutation(len(train))[:world_size] if len(train) >= world_size else view_rng.integers(0, len(train), world_size)
        view = train[order[rank]]
        sh_degree = min(step // 1000, 3)
        img, info = rasterize(params, view, sh_degree, device)
        info["means2d"].retain_grad()
        gt = view["img"].to(device, non_blocking=True)
        l1 = F.l1_loss(img, gt)
        x, y = img.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]
        mx, my = F.avg_pool2d(x, 11, 1, 5), F.avg_pool2d(y, 11, 1, 5)
        vx, vy = F.avg_pool2d(x * x, 11, 1, 5) - mx ** 2, F.avg_pool2d(y * y, 11, 1, 5) - my ** 2
        cxy = F.avg_pool2d(x * y, 11, 1, 5) - mx * my
        ssim = ((2 * mx * my + 1e-4) * (2 * cxy + 9e-4) / ((mx ** 2 + my ** 2 + 1e-4) * (vx + vy + 9e-4))).mean()
        loss = (1 - cfg.ssim_lambda) * l1 + cfg.ssim_lambda * (1 - ssim)
        loss.backward()

        for k in params:
            dist.all_reduce(params[k].grad, op=dist.ReduceOp.SUM)
            params[k].grad.div_(world_size)

        if step < cfg.refine_stop:
            with torch.no_grad():
                g = info["means2d"].grad[0].clone()
                g[:, 0] *= gt.shape[1] / 2.0
                g[:, 1] *= gt.shape[0] / 2.0
                vis = info["radii"][0] > 0
                vis = vis.all(-1) if vis.dim() == 2 else vis
                grad2d[vis] += g[vis].norm(dim=-1)
                count[vis] += 1

        for opt in optims.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        optims["means"].param_groups[0]["lr"] *= means_decay

        if cfg.refine_start < step < cfg.refine_stop and step % cfg.refine_every == 0:
            stats = torch.stack([grad2d, count])
            dist.all_reduce(stats)
            n_dup, n_split, n_prune = refine(params, optims, stats[0], stats[1], cfg, extent, gen)
            # replicas must stay bit-identical; rank 0 is the reference
            for v in params.values():
                dist.broadcast(v.data, src=0)
            grad2d = torch.zeros(params["means"].shape[0], device=device)
            count = torch.zeros_like(grad2d)
            if rank == 0:
                print(f"step {step}: +{n_dup} dup, +{n_split} split, -{n_prune} pruned -> {params['means'].shape[0]}", flush=True)
        if cfg.refine_start < step < cfg.refine_stop and step % cfg.reset_every == 0:
            update_params(params, optims, lambda k, t: t.clamp(max=math.log(0.01 / 0.99)) if k == "opacities" else t,
                          lambda s: s)

        if step % 7000 == 6999 or step == cfg.steps - 1:
            evaluate(params, test, rank, world_size, device, step)

    if rank == 0:
        os.makedirs(cfg.result, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in params.items()}, os.path.join(cfg.result, "splats.pt"))
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(params, test, rank, world_size, device, step):
    psnr, lpips = PeakSignalNoiseRatio(data_range=1.0).to(device), LearnedPerceptualImagePatchSimilarity(normalize=True).to(device)
    acc = torch.zeros(3, device=device)
    for view in test[rank::world_size]:
        img, _ = rasterize(params, view, 3, device)
        p, g = img.clamp(0, 1).permute(2, 0, 1)[None], view["img"].to(device).permute(2, 0, 1)[None]
        acc += torch.stack([psnr(p, g), lpips(p, g), torch.ones((), device=device)])
    dist.all_reduce(acc)
    if rank == 0:
        print(f"[eval step {step}] PSNR {acc[0] / acc[2]:.3f}  LPIPS {acc[1] / acc[2]:.4f}  ({int(acc[2])} views)", flush=True)


if __name__ == "__main__":
    cfg = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)
