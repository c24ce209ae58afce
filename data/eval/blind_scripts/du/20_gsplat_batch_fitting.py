"""Fit 3D Gaussian Splatting to every scene of a collection (DL3DV-style), one scene
per GPU at a time, to build a dataset of Gaussian assets. No gradient exchange:
the processes only share the final metrics table.

    torchrun --nproc_per_node=8 20_gsplat_batch_fitting.py --scenes_txt lists/dl3dv_1k.txt \
        --data_root /data/dl3dv --out_root /data/dl3dv_gs
"""
import argparse
import datetime
import json
import math
import os
import time

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gsplat import rasterization
from gsplat.strategy import DefaultStrategy
from plyfile import PlyData
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn
from torchmetrics.image import StructuralSimilarityIndexMeasure
from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scenes_txt", required=True)
    p.add_argument("--data_root", required=True)
    p.add_argument("--out_root", required=True)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--sh_degree", type=int, default=3)
    p.add_argument("--ssim_lambda", type=float, default=0.2)
    p.add_argument("--test_every", type=int, default=8)
    return p.parse_args()


def load_scene(path):
    with open(os.path.join(path, "transforms.json")) as f:
        meta = json.load(f)
    K = np.array([[meta["fl_x"], 0, meta["cx"]], [0, meta["fl_y"], meta["cy"]], [0, 0, 1]], dtype=np.float32)
    views = []
    for fr in sorted(meta["frames"], key=lambda x: x["file_path"]):
        c2w = np.array(fr["transform_matrix"], dtype=np.float32) @ np.diag([1, -1, -1, 1]).astype(np.float32)
        img = imageio.imread(os.path.join(path, fr["file_path"]))[..., :3]
        views.append((torch.from_numpy(img), torch.from_numpy(np.linalg.inv(c2w))))
    v = PlyData.read(os.path.join(path, "sparse_pc.ply"))["vertex"]
    pts = np.stack([v["x"], v["y"], v["z"]], -1).astype(np.float32)
    cols = np.stack([v["red"], v["green"], v["blue"]], -1).astype(np.float32) / 255.0
    return views, torch.from_numpy(K), torch.from_numpy(pts), torch.from_numpy(cols)


def create_splats(pts, cols, sh_degree, scene_scale, device):
    n = pts.shape[0]
    dist2 = torch.cdist(pts, pts).topk(4, largest=False).values[:, 1:].pow(2).mean(-1) if n < 60000 else \
        torch.full((n,), (0.01 * scene_scale) ** 2)
    splats = torch.nn.ParameterDict({
        "means": torch.nn.Parameter(pts),
        "scales": torch.nn.Parameter(torch.log(dist2.clamp_min(1e-8).sqrt())[:, None].repeat(1, 3)),
        "quats": torch.nn.Parameter(torch.rand(n, 4)),
        "opacities": torch.nn.Parameter(torch.logit(torch.full((n,), 0.1))),
        "sh0": torch.nn.Parameter(((cols - 0.5) / 0.28209479177387814)[:, None]),
        "shN": torch.nn.Parameter(torch.zeros(n, (sh_degree + 1) ** 2 - 1, 3)),
    }).to(device)
    lrs = {"means": 1.6e-4 * scene_scale, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2, "sh0": 2.5e-3, "shN": 2.5e-3 / 20}
    optims = {k: torch.optim.Adam([{"params": splats[k], "lr": lr, "name": k}], eps=1e-15) for k, lr in lrs.items()}
    return splats, optims


def render(splats, viewmat, K, W, H, sh_degree):
    colors = torch.cat([splats["sh0"], splats["shN"]], 1)
    img, alpha, info = rasterization(splats["means"], splats["quats"], torch.exp(splats["scales"]),
                                     torch.sigmoid(splats["opacities"]), colors, viewmat[None], K[None], W, H,
                                     sh_degree=sh_degree, packed=False)
    return img[0], info


class Evaluator:
    def __init__(self):
        self.ssim = StructuralSimilarityIndexMeasure(data_range=1.0).to("cuda:0")
        self.lpips = LearnedPerceptualImagePatchSimilarity(net_type="vgg", normalize=True).to("cuda:0")

    @torch.no_grad()
    def __call__(self, pred, gt):
        p, g = pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]
        return {"psnr": (-10 * torch.log10(F.mse_loss(p, g))).item(),
                "ssim": self.ssim(p, g).item(), "lpips": self.lpips(p, g).item()}


def fit_scene(name, args, device, evaluator):
    views, K, pts, cols = load_scene(os.path.join(args.data_root, name))
    K = K.to(device)
    train = [v for i, v in enumerate(views) if i % args.test_every != 0]
    test = [v for i, v in enumerate(views) if i % args.test_every == 0]
    centers = torch.stack([torch.linalg.inv(vm)[:3, 3] for _, vm in views])
    scene_scale = float((centers - centers.mean(0)).norm(dim=-1).max()) * 1.1

    splats, optims = create_splats(pts, cols, args.sh_degree, scene_scale, device)
    strategy = DefaultStrategy(verbose=False)
    strategy.check_sanity(splats, optims)
    state = strategy.initialize_state(scene_scale=scene_scale)
    decay = 0.01 ** (1.0 / args.steps)

    order = torch.randperm(len(train)).tolist()
    for step in range(args.steps):
        if not order:
            order = torch.randperm(len(train)).tolist()
        img_u8, viewmat = train[order.pop()]
        gt = img_u8.to(device).float() / 255.0
        H, W = gt.shape[:2]
        pred, info = render(splats, viewmat.to(device), K, W, H, min(step // 1000, args.sh_degree))
        strategy.step_pre_backward(splats, optims, state, step, info)
        l1 = F.l1_loss(pred, gt)
        ssim_l = 1 - ssim_fn(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], data_range=1.0)
        loss = (1 - args.ssim_lambda) * l1 + args.ssim_lambda * ssim_l
        loss.backward()
        for opt in optims.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        optims["means"].param_groups[0]["lr"] *= decay
        strategy.step_post_backward(splats, optims, state, step, info, packed=False)

    metrics = []
    with torch.no_grad():
        for img_u8, viewmat in test:
            gt = img_u8.to(device).float() / 255.0
            pred, _ = render(splats, viewmat.to(device), K, gt.shape[1], gt.shape[0], args.sh_degree)
            metrics.append(evaluator(pred.clamp(0, 1), gt))
    out = os.path.join(args.out_root, name)
    os.makedirs(out, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in splats.items()}, os.path.join(out, "splats.pt"))
    res = {k: float(np.mean([m[k] for m in metrics])) for k in ("psnr", "ssim", "lpips")}
    res["num_gaussians"] = int(splats["means"].shape[0])
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(res, f)
    return res


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # ranks finish their scene lists at different times; only the final gather waits on the others
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=24))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(args.scenes_txt) as f:
        scenes = [s.strip() for s in f if s.strip()]
    evaluator = Evaluator()
    results = {}
    for name in scenes[rank::world]:
        if os.path.exists(os.path.join(args.out_root, name, "metrics.json")):
            with open(os.path.join(args.out_root, name, "metrics.json")) as f:
                results[name] = json.load(f)
            continue
        torch.manual_seed(0)
        t0 = time.time()
        results[name] = fit_scene(name, args, device, evaluator)
        print(f"[rank {rank}] {name}: PSNR {results[name]['psnr']:.2f}  {time.time() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        allres = {k: v for part in gathered for k, v in part.items()}
        summary = {m: float(np.mean([r[m] for r in allres.values()])) for m in ("psnr", "ssim", "lpips")}
        with open(os.path.join(args.out_root, "summary.json"), "w") as f:
            json.dump({"mean": summary, "per_scene": allres}, f, indent=1)
        print(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
