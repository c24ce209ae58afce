"""
FID-50k evaluation of a trained class-conditional pixel-space diffusion model (EMA weights).
Sampling is split over all GPUs; Inception-v3 pool3 statistics are compared against
precomputed reference statistics (mu, sigma) of the training set.

    torchrun --nproc_per_node=8 06_in64_fid_eval.py --ckpt runs/in64/checkpoint-400000 \
        --ref_stats stats/imagenet64_train.npz --num_samples 50000 --cfg_scale 1.5
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDIMScheduler, UNet2DModel
from pytorch_fid.inception import InceptionV3
from scipy import linalg
from tqdm import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True, help="directory with unet_ema/ and scheduler/")
    p.add_argument("--ref_stats", required=True)
    p.add_argument("--num_samples", type=int, default=50_000)
    p.add_argument("--batch_size", type=int, default=125, help="per GPU")
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eta", type=float, default=0.0)
    p.add_argument("--cfg_scale", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="json file for the result")
    p.add_argument("--save_npz", action="store_true")
    return p.parse_args()


def frechet_distance(mu1, sigma1, mu2, sigma2, eps=1e-6):
    diff = mu1 - mu2
    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2), disp=False)
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


@torch.no_grad()
def sample_batch(unet, scheduler, labels, args, generator):
    n = labels.shape[0]
    device = labels.device
    shape = (n, unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    x = torch.randn(shape, generator=generator, device=device)
    null = torch.full_like(labels, args.num_classes)
    y = torch.cat([labels, null])
    scheduler.set_timesteps(args.steps, device=device)
    for t in scheduler.timesteps:
        xin = torch.cat([x, x])
        with torch.autocast("cuda", dtype=torch.float16):
            eps = unet(xin, t, class_labels=y).sample.float()
        e_c, e_u = eps.chunk(2)
        eps = e_u + args.cfg_scale * (e_c - e_u)
        x = scheduler.step(eps, t, x, eta=args.eta, generator=generator).prev_sample
    return (x.clamp(-1, 1) + 1) / 2  # [0, 1]


@torch.no_grad()
def inception_features(inception, images):
    # pytorch_fid's InceptionV3 resizes to 299 and normalises internally, expects [0, 1]
    return inception(images)[0].squeeze(-1).squeeze(-1)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    unet = UNet2DModel.from_pretrained(os.path.join(args.ckpt, "unet_ema")).to(device).eval()
    scheduler = DDIMScheduler.from_pretrained(os.path.join(args.ckpt, "scheduler"))
    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()

    global_batch = args.batch_size * world
    n_batches = int(np.ceil(args.num_samples / global_batch))
    if rank == 0:
        print(f"sampling {args.num_samples} images: {n_batches} batches of {args.batch_size} on {world} GPUs")

    generator = torch.Generator(device=device).manual_seed(args.seed * world + rank)
    feats, images_u8 = [], []
    t0 = time.time()
    for _ in tqdm(range(n_batches), disable=rank != 0):
        labels = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)
        imgs = sample_batch(unet, scheduler, labels, args, generator)
        feats.append(inception_features(inception, imgs).double().cpu())
        if args.save_npz:
            images_u8.append((imgs * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu())
    feats = torch.cat(feats).numpy()

    if args.save_npz:
        arr = torch.cat(images_u8).numpy()
        np.savez(os.path.join(args.ckpt, f"samples_rank{rank:02d}.npz"), arr_0=arr)

    mu = np.mean(feats, axis=0)
    sigma = np.cov(feats, rowvar=False)
    ref = np.load(args.ref_stats)
    fid = frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
    dist.barrier()

    if rank == 0:
        elapsed = time.time() - t0
        result = {"ckpt": args.ckpt, "fid": fid, "num_samples": args.num_samples, "cfg_scale": args.cfg_scale,
                  "steps": args.steps, "eta": args.eta, "sampling_time_s": elapsed}
        print(json.dumps(result, indent=2))
        out = args.out or os.path.join(args.ckpt, f"fid_cfg{args.cfg_scale}_s{args.steps}.json")
        with open(out, "w") as f:
            json.dump(result, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
