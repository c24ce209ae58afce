#!/usr/bin/env python
"""
FID-50k for an unconditional CIFAR-10 DDPM (diffusers format, e.g. the output of a train_unconditional run
or google/ddpm-cifar10-32), sampled with DDIM on all GPUs.

    torchrun --nproc_per_node=8 20_cifar_ddim_fid50k.py --model_dir runs/ddpm-cifar10/unet_ema \
        --ref /data/fid_stats/cifar10_train.npz --steps 100 --out runs/ddpm-cifar10/fid.json
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from diffusers import DDIMScheduler, UNet2DModel
from pytorch_fid.inception import InceptionV3
from scipy import linalg
from tqdm import tqdm


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--ref", required=True, help="npz with mu / sigma of the training set")
    ap.add_argument("--num_samples", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=250, help="per GPU")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eta", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump_images", action="store_true")
    ap.add_argument("--save_stats", default=None, help="also write mu/sigma of the generated set to this npz")
    return ap.parse_args()


def calculate_frechet_distance(mu1, sigma1, mu2, sigma2, eps=1e-6):
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    diff = mu1 - mu2
    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2), disp=False)
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"imaginary component {np.max(np.abs(covmean.imag))}")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


@torch.no_grad()
def ddim_batch(unet, scheduler, n, steps, eta, generator, device):
    size = unet.config.sample_size
    x = torch.randn((n, unet.config.in_channels, size, size), generator=generator, device=device)
    scheduler.set_timesteps(steps, device=device)
    for t in scheduler.timesteps:
        with torch.autocast("cuda", dtype=torch.float16):
            eps = unet(x, t).sample
        x = scheduler.step(eps.float(), t, x, eta=eta, generator=generator).prev_sample
    return (x.clamp(-1, 1) + 1) / 2


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    assert args.num_samples % (world * args.batch) == 0, "num_samples must be divisible by world * batch"
    n_iters = args.num_samples // (world * args.batch)

    unet = UNet2DModel.from_pretrained(args.model_dir).to(device).eval()
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=True)
    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    gen = torch.Generator(device=device).manual_seed(args.seed * world + rank)

    if args.dump_images:
        img_dir = os.path.join(os.path.dirname(args.model_dir.rstrip("/")), f"samples_ddim{args.steps}")
        os.makedirs(img_dir, exist_ok=True)

    feats = []
    t0 = time.time()
    for it in tqdm(range(n_iters), disable=rank != 0, desc="sampling"):
        imgs = ddim_batch(unet, scheduler, args.batch, args.steps, args.eta, gen, device)
        with torch.no_grad():
            f = inception(imgs)[0].squeeze(3).squeeze(2)
        feats.append(f.double().cpu())
        if args.dump_images:
            u8 = (imgs * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            base = (it * world + rank) * args.batch
            np.save(os.path.join(img_dir, f"{base:06d}.npy"), u8)
    feats = torch.cat(feats)

    gathered = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(gathered, feats)
    elapsed = time.time() - t0

    if rank == 0:
        allf = torch.cat(gathered).numpy()
        assert allf.shape[0] == args.num_samples
        mu, sigma = allf.mean(axis=0), np.cov(allf, rowvar=False)
        ref = np.load(args.ref)
        fid = calculate_frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
        if args.save_stats:
            np.savez(args.save_stats, mu=mu, sigma=sigma)
            print(f"wrote generated-set statistics to {args.save_stats}")
        result = {"model": args.model_dir, "fid": fid, "num_samples": args.num_samples, "ddim_steps": args.steps,
                  "eta": args.eta, "seconds": round(elapsed, 1), "gpus": world}
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as fp:
                json.dump(result, fp, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
