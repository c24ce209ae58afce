"""Instant-NGP style hash-grid NeRF (tiny-cuda-nn), multi-GPU data parallel.

Each GPU samples its own ray batch from random training images every step.
Resume a run with --resume <run>/ckpt_XXXXX.pth.

    torchrun --nproc_per_node=8 06_hashgrid_nerf.py --scene data/ngp/fox --run runs/fox
"""
import argparse
import json
import math
import os
import time

import numpy as np
import tinycudann as tcnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn
from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scene", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--batch_rays", type=int, default=1 << 15, help="rays per step, all GPUs together")
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--holdout", type=int, default=10, help="every n-th image is a test view")
    ap.add_argument("--ckpt_every", type=int, default=5000)
    ap.add_argument("--eval_every", type=int, default=10_000)
    return ap.parse_args()


class Scene:
    def __init__(self, root):
        meta = json.load(open(os.path.join(root, "transforms.json")))
        self.aabb_scale = meta.get("aabb_scale", 1)
        self.w, self.h = int(meta["w"]), int(meta["h"])
        self.K = (meta["fl_x"], meta["fl_y"], meta["cx"], meta["cy"])
        frames = sorted(meta["frames"], key=lambda f: f["file_path"])
        self.images, self.c2w = [], []
        for f in frames:
            img = np.asarray(Image.open(os.path.join(root, f["file_path"])).convert("RGB"), dtype=np.float32) / 255.0
            self.images.append(torch.from_numpy(img))
            m = np.array(f["transform_matrix"], dtype=np.float32)
            m[:3, 3] = m[:3, 3] * 0.33 + 0.5  # ngp's scale/offset into the unit cube
            self.c2w.append(torch.from_numpy(m))
        self.images, self.c2w = torch.stack(self.images), torch.stack(self.c2w)

    def rays(self, ids, px, py):
        fx, fy, cx, cy = self.K
        d = torch.stack([(px + 0.5 - cx) / fx, -(py + 0.5 - cy) / fy, -torch.ones_like(px, dtype=torch.float32)], -1)
        R, t = self.c2w[ids, :3, :3], self.c2w[ids, :3, 3]
        d = (R @ d[..., None]).squeeze(-1)
        return t, F.normalize(d, dim=-1)


class NGPField(nn.Module):
    def __init__(self, aabb_scale, levels=16, log2_T=19):
        super().__init__()
        self.bound = float(aabb_scale)
        per_level = math.exp(math.log(2048 * aabb_scale / 16) / (levels - 1))
        self.density = tcnn.NetworkWithInputEncoding(
            3, 16,
            {"otype": "HashGrid", "n_levels": levels, "n_features_per_level": 2, "log2_hashmap_size": log2_T,
             "base_resolution": 16, "per_level_scale": per_level},
            {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None", "n_neurons": 64, "n_hidden_layers": 1})
        self.dir_enc = tcnn.Encoding(3, {"otype": "SphericalHarmonics", "degree": 4})
        self.color = tcnn.Network(16 + self.dir_enc.n_output_dims, 3,
                                  {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "Sigmoid",
                                   "n_neurons": 64, "n_hidden_layers": 2})

    def forward(self, pts, dirs):
        x = (pts - 0.5) / self.bound + 0.5
        inside = ((x >= 0) & (x <= 1)).all(-1, keepdim=True)
        h = self.density(x.clamp(0, 1))
        sigma = torch.exp(h[:, :1].float()).clamp(max=1e4) * inside
        rgb = self.color(torch.cat([h, self.dir_enc((dirs + 1) / 2)], -1)).float()
        return sigma.squeeze(-1), rgb


class Renderer(nn.Module):
    def __init__(self, field, samples):
        super().__init__()
        self.field, self.samples = field, samples

    def forward(self, o, d, bg, perturb=True):
        n = o.shape[0]
        near, far = 0.05, 0.5 + math.sqrt(3) * self.field.bound
        t = torch.linspace(near, far, self.samples + 1, device=o.device).expand(n, -1)
        if perturb:
            t = t + (torch.rand(n, 1, device=o.device) - 0.5) * (far - near) / self.samples
        mid = 0.5 * (t[:, 1:] + t[:, :-1])
        pts = o[:, None] + d[:, None] * mid[..., None]
        sigma, rgb = self.field(pts.view(-1, 3), d[:, None].expand_as(pts).reshape(-1, 3))
        sigma, rgb = sigma.view(n, -1), rgb.view(n, -1, 3)
        tau = sigma * (t[:, 1:] - t[:, :-1])
        alpha = 1 - torch.exp(-tau)
        trans = torch.exp(-torch.cat([torch.zeros_like(tau[:, :1]), tau.cumsum(-1)[:, :-1]], -1))
        w = alpha * trans
        return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True)) * bg


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    scene = Scene(args.scene)
    n_img = scene.images.shape[0]
    test_ids = list(range(0, n_img, args.holdout))
    train_ids = torch.tensor([i for i in range(n_img) if i not in test_ids])
    images = scene.images.to(dev)
    scene.c2w = scene.c2w.to(dev)

    model = Renderer(NGPField(scene.aabb_scale), args.samples).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-15)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [args.steps // 2, args.steps * 3 // 4, args.steps * 9 // 10], 0.33)
    scaler = torch.cuda.amp.GradScaler(2 ** 10)
    step = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)
    ddp = DDP(model, device_ids=[local_rank])

    rays_per_gpu = args.batch_rays // world
    gen = torch.Generator(device=dev).manual_seed(1234 + 7919 * rank)
    lpips_metric = LearnedPerceptualImagePatchSimilarity(net_type="alex", normalize=True).to(dev)
    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
    tic = time.time()
    while step < args.steps:
        step += 1
        ids = train_ids.to(dev)[torch.randint(len(train_ids), (rays_per_gpu,), device=dev, generator=gen)]
        px = torch.randint(scene.w, (rays_per_gpu,), device=dev, generator=gen)
        py = torch.randint(scene.h, (rays_per_gpu,), device=dev, generator=gen)
        o, d = scene.rays(ids, px, py)
        bg = torch.rand(rays_per_gpu, 3, device=dev, generator=gen)  # random background, as in instant-ngp
        target = images[ids, py, px]
        with torch.autocast("cuda", dtype=torch.float16):
            pred = ddp(o, d, bg)
        loss = F.smooth_l1_loss(pred.float(), target, beta=0.1)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

        if step % 250 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.5f} {(time.time() - tic) / 250 * 1e3:.1f} ms/it", flush=True)
                tic = time.time()

        if step % args.ckpt_every == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "step": step}, os.path.join(args.run, f"ckpt_{step:06d}.pth"))

        if step % args.eval_every == 0 or step == args.steps:
            totals = torch.zeros(4, device=dev)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                for i in test_ids[rank::world]:
                    py_, px_ = torch.meshgrid(torch.arange(scene.h, device=dev), torch.arange(scene.w, device=dev), indexing="ij")
                    o, d = scene.rays(torch.full_like(px_.flatten(), i), px_.flatten(), py_.flatten())
                    white = torch.ones_like(o)
                    pred = torch.cat([model(o[s:s + 16384], d[s:s + 16384], white[s:s + 16384], perturb=False)
                                      for s in range(0, o.shape[0], 16384)]).float().view(scene.h, scene.w, 3)
                    gt = images[i]
                    p, g = pred.permute(2, 0, 1)[None].clamp(0, 1), gt.permute(2, 0, 1)[None]
                    totals += torch.stack([-10 * torch.log10(F.mse_loss(p, g)), ssim_fn(p, g, data_range=1.0),
                                           lpips_metric(p, g), torch.ones((), device=dev)])
            dist.all_reduce(totals)
            if rank == 0:
                n = totals[3].item()
                print(f"[eval {step}] PSNR {totals[0].item() / n:.2f} SSIM {totals[1].item() / n:.4f} "
                      f"LPIPS {totals[2].item() / n:.4f} on {int(n)} views", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
