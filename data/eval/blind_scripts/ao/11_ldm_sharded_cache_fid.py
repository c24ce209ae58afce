"""
Unconditional latent diffusion on LSUN-bedroom 256 (SD VAE, f=8).

Latents are precomputed once: every rank encodes a strided shard and writes its own
file, then everybody loads all shards. FID-5k during training is computed from the
inception features of all ranks gathered on rank 0.

torchrun --nproc_per_node=8 ldm_bedroom.py --images /data/lsun/bedroom_256 --cache /data/cache/bedroom_sdvae --out runs/ldm_bedroom
"""
import argparse
import contextlib
import copy
import datetime
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DModel
from PIL import Image
from pytorch_fid.fid_score import calculate_frechet_distance
from pytorch_fid.inception import InceptionV3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.utils import save_image


@torch.no_grad()
def encode_shard(files, vae, device, out_path, bs=64):
    tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(256), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    zs = []
    for i in range(0, len(files), bs):
        x = torch.stack([tf(Image.open(f).convert("RGB")) for f in files[i:i + bs]]).to(device)
        zs.append((vae.encode(x).latent_dist.mean * vae.config.scaling_factor).half().cpu())
    tmp = out_path + ".tmp"
    torch.save(torch.cat(zs), tmp)
    os.replace(tmp, out_path)


def prepare_latents(args, vae, device, rank, world):
    files = sorted(glob.glob(os.path.join(args.images, "*.jpg")) + glob.glob(os.path.join(args.images, "*.png")))
    os.makedirs(args.cache, exist_ok=True)
    shard = os.path.join(args.cache, f"shard_{rank:02d}_of_{world:02d}.pt")
    if not os.path.exists(shard):
        encode_shard(files[rank::world], vae, device, shard)
    dist.barrier()
    shards = [torch.load(os.path.join(args.cache, f"shard_{r:02d}_of_{world:02d}.pt")) for r in range(world)]
    return torch.cat(shards)


@torch.no_grad()
def ddim(unet, sched, n, device, steps=50, gen=None):
    sched.set_timesteps(steps)
    x = torch.randn(n, 4, 32, 32, device=device, generator=gen)
    for t in sched.timesteps:
        x = sched.step(unet(x, t.to(device)).sample, t, x).prev_sample
    return x


@torch.no_grad()
def fid_all_ranks(ema, vae, sched, inception, ref, n_total, device, rank, world, bs=50):
    per_rank = math.ceil(n_total / world)
    gen = torch.Generator(device=device).manual_seed(10_000 + rank)
    feats = []
    for s in range(0, per_rank, bs):
        b = min(bs, per_rank - s)
        img = vae.decode(ddim(ema, sched, b, device, gen=gen) / vae.config.scaling_factor).sample
        img = ((img + 1) / 2).clamp(0, 1)
        feats.append(inception(img)[0].flatten(1))
    feats = torch.cat(feats)
    gathered = torch.empty(world * per_rank, feats.shape[1], device=device, dtype=feats.dtype)
    dist.all_gather_into_tensor(gathered, feats)
    if rank != 0:
        return None
    f = gathered[:n_total].double().cpu().numpy()
    return float(calculate_frechet_distance(f.mean(0), np.cov(f, rowvar=False), ref["mu"], ref["sigma"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", default="runs/ldm")
    ap.add_argument("--fid_ref", default="stats/lsun_bedroom_256.npz")
    ap.add_argument("--micro_bs", type=int, default=32)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--fid_every", type=int, default=20_000)
    ap.add_argument("--fid_n", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # encoding the shards can take a while before the first barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    vae = AutoencoderKL.from_pretrained("stabilityai/sd-vae-ft-ema").to(device).eval().requires_grad_(False)
    latents = prepare_latents(args, vae, device, rank, world)
    if rank == 0:
        print(f"{len(latents)} latents, global batch {args.micro_bs * args.accum * world}", flush=True)

    ds = TensorDataset(latents)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2, drop_last=True, pin_memory=True)

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=2,
                       block_out_channels=(224, 448, 672, 896),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D")).to(device)
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    opt = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=0.0)
    step = 0
    last = os.path.join(args.out, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        unet.load_state_dict(ck["unet"]); ema.load_state_dict(ck["ema"]); opt.load_state_dict(ck["opt"])
        step = ck["step"]
    model = DDP(unet, device_ids=[local_rank])
    torch.manual_seed(1234 + rank)

    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", clip_sample=False)
    abar = sched.alphas_cumprod.to(device)
    inception = InceptionV3([3]).to(device).eval()
    ref = np.load(args.fid_ref)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    it = iter(dl)
    epoch = 0
    sampler.set_epoch(epoch)
    t0 = time.time()
    while step < args.steps:
        opt.zero_grad(set_to_none=True)
        tot = 0.0
        for micro in range(args.accum):
            try:
                (z,) = next(it)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                it = iter(dl)
                (z,) = next(it)
            z = z.to(device, non_blocking=True).float()
            z = torch.where(torch.rand(z.size(0), 1, 1, 1, device=device) < 0.5, z.flip(-1), z)
            t = torch.randint(0, 1000, (z.size(0),), device=device)
            noise = torch.randn_like(z)
            a = abar[t].view(-1, 1, 1, 1)
            ctx = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with ctx:
                pred = model(a.sqrt() * z + (1 - a).sqrt() * noise, t).sample
                loss = F.mse_loss(pred, noise) / args.accum
                loss.backward()
            tot += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            d = min(0.9999, (1 + step) / (10 + step))
            for pe, p in zip(ema.parameters(), unet.parameters()):
                pe.lerp_(p, 1 - d)

        if step % 100 == 0:
            l = torch.tensor([tot], device=device)
            dist.all_reduce(l)
            if rank == 0:
                print(f"step {step} loss {l.item() / world:.4f} {(time.time() - t0) / 100:.2f}s/step", flush=True)
                t0 = time.time()

        if step % args.fid_every == 0:
            fid = fid_all_ranks(ema, vae, copy.deepcopy(sched), inception, ref, args.fid_n, device, rank, world)
            if rank == 0:
                print(f"step {step} FID-{args.fid_n // 1000}k {fid:.2f}", flush=True)

        if step % args.save_every == 0:
            if rank == 0:
                imgs = vae.decode(ddim(ema, copy.deepcopy(sched), 16, device) / vae.config.scaling_factor).sample
                save_image(imgs * 0.5 + 0.5, os.path.join(args.out, f"s_{step:07d}.png"), nrow=4)
                torch.save({"unet": unet.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                            "step": step}, last + ".tmp")
                os.replace(last + ".tmp", last)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
