"""Stage-2 refinement of a trained 3DGS scene with per-image exposure compensation, multi-GPU.

Loads a densified point_cloud.ply (3DGS format), freezes the Gaussian count and fine-tunes
all attributes plus a per-image affine colour transform. The training views are sharded
across GPUs; every GPU walks over its own views once per epoch.

    torchrun --nproc_per_node=4 20_gs_multiview_finetune.py --scene data/mipnerf360/kitchen \
        --ply output/kitchen/point_cloud/iteration_30000/point_cloud.ply --out output/kitchen_refine
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gsplat import rasterization
from PIL import Image
from plyfile import PlyData
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--scene", required=True)
    p.add_argument("--ply", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--downscale", type=int, default=4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr_scale", type=float, default=0.1, help="fraction of the stage-1 learning rates")
    p.add_argument("--ssim_w", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_ply(path):
    v = PlyData.read(path)["vertex"]
    names = [p.name for p in v.properties]
    get = lambda prefix: np.stack([v[n] for n in sorted((n for n in names if n.startswith(prefix)),
                                                         key=lambda s: int(s.split("_")[-1]))], 1)
    xyz = np.stack([v["x"], v["y"], v["z"]], 1)
    f_dc = get("f_dc_")[:, None, :]
    f_rest = get("f_rest_").reshape(len(xyz), 3, -1).transpose(0, 2, 1)
    return {"means": xyz, "sh0": f_dc, "shN": f_rest, "opacities": np.asarray(v["opacity"]),
            "scales": get("scale_"), "quats": get("rot_")}


def load_cameras(root, downscale):
    meta = json.load(open(os.path.join(root, "transforms.json")))
    cams = []
    for fr in sorted(meta["frames"], key=lambda f: f["file_path"]):
        im = Image.open(os.path.join(root, fr["file_path"])).convert("RGB")
        im = im.resize((im.width // downscale, im.height // downscale), Image.BICUBIC)
        c2w = np.array(fr["transform_matrix"], np.float32)
        c2w[:3, 1:3] *= -1
        K = np.array([[meta["fl_x"] / downscale, 0, meta["cx"] / downscale],
                      [0, meta["fl_y"] / downscale, meta["cy"] / downscale], [0, 0, 1]], np.float32)
        cams.append({"img": torch.from_numpy(np.asarray(im, np.float32) / 255.0),
                     "viewmat": torch.from_numpy(np.linalg.inv(c2w)), "K": torch.from_numpy(K)})
    return cams


class SceneModel(nn.Module):
    def __init__(self, splats, n_images):
        super().__init__()
        self.splats = nn.ParameterDict({k: nn.Parameter(torch.as_tensor(v, dtype=torch.float32)) for k, v in splats.items()})
        # per-image 3x4 affine colour correction, initialised to identity
        self.exposure = nn.Embedding(n_images, 12)
        with torch.no_grad():
            self.exposure.weight.copy_(torch.eye(3, 4).flatten().repeat(n_images, 1))

    def forward(self, viewmat, K, width, height, image_id=None):
        s = self.splats
        img, _, _ = rasterization(s["means"], F.normalize(s["quats"], dim=-1), s["scales"].exp(), torch.sigmoid(s["opacities"]),
                                  torch.cat([s["sh0"], s["shN"]], 1), viewmat[None], K[None], width, height, sh_degree=3)
        img = img[0]
        if image_id is not None:
            A = self.exposure(image_id).view(3, 4)
            img = img @ A[:, :3].T + A[:, 3]
        return img


def ssim_loss(a, b):
    a, b = a.permute(2, 0, 1)[None], b.permute(2, 0, 1)[None]
    mu_a, mu_b = F.avg_pool2d(a, 11, 1, 5), F.avg_pool2d(b, 11, 1, 5)
    va, vb = F.avg_pool2d(a * a, 11, 1, 5) - mu_a ** 2, F.avg_pool2d(b * b, 11, 1, 5) - mu_b ** 2
    cab = F.avg_pool2d(a * b, 11, 1, 5) - mu_a * mu_b
    return 1 - ((2 * mu_a * mu_b + 1e-4) * (2 * cab + 9e-4) / ((mu_a ** 2 + mu_b ** 2 + 1e-4) * (va + vb + 9e-4))).mean()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    cams = load_cameras(args.scene, args.downscale)
    test_ids = list(range(0, len(cams), 8))
    train_ids = [i for i in range(len(cams)) if i % 8]
    my_ids = train_ids[rank::world]

    model = SceneModel(read_ply(args.ply), len(cams)).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    s = args.lr_scale * math.sqrt(world)  # one view per GPU per step
    opt = torch.optim.Adam([
        {"params": [model.splats["means"]], "lr": 1.6e-5 * s},
        {"params": [model.splats["sh0"]], "lr": 2.5e-3 * s}, {"params": [model.splats["shN"]], "lr": 2.5e-3 / 20 * s},
        {"params": [model.splats["opacities"]], "lr": 5e-2 * s}, {"params": [model.splats["scales"]], "lr": 5e-3 * s},
        {"params": [model.splats["quats"]], "lr": 1e-3 * s}, {"params": model.exposure.parameters(), "lr": 1e-3 * math.sqrt(world)}], eps=1e-15)
    lpips = LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True).to(device)
    rng = random.Random(args.seed + rank)

    step = 0
    for epoch in range(args.epochs):
        order = my_ids[:]
        rng.shuffle(order)
        running = torch.zeros(2, device=device)
        for i in order:
            cam = cams[i]
            gt = cam["img"].to(device, non_blocking=True)
            H, W = gt.shape[:2]
            pred = ddp(cam["viewmat"].to(device), cam["K"].to(device), W, H, torch.tensor(i, device=device))
            loss = (1 - args.ssim_w) * F.l1_loss(pred, gt) + args.ssim_w * ssim_loss(pred, gt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch:3d} | mean loss {running[0] / running[1]:.4f} | {int(running[1])} views", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            m = torch.zeros(3, device=device)
            with torch.no_grad():
                for i in test_ids[rank::world]:
                    gt = cams[i]["img"].to(device)
                    pred = model(cams[i]["viewmat"].to(device), cams[i]["K"].to(device), gt.shape[1], gt.shape[0]).clamp(0, 1)
                    p, g = pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None]
                    m += torch.stack([-10 * torch.log10(F.mse_loss(p, g)), lpips(p, g), torch.ones((), device=device)])
            dist.all_reduce(m)
            if rank == 0:
                print(f"  test PSNR {m[0] / m[2]:.3f}  LPIPS {m[1] / m[2]:.4f} on {int(m[2])} views", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"splats": {k: v.detach().cpu() for k, v in model.splats.items()},
                            "exposure": model.exposure.weight.detach().cpu(), "epoch": epoch},
                           os.path.join(args.out, "refined.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
