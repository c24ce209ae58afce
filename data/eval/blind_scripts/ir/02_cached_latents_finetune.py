#!/usr/bin/env python
# Full UNet fine-tuning of SD 2.1-base on a captioned dataset, with VAE latents cached to disk
# so the VAE encoder only runs once. EMA of the UNet weights is kept for sampling.
#
#   torchrun --nproc_per_node 8 02_cached_latents_finetune.py --config configs/ft_sd21.yaml
import argparse
import copy
import csv
import hashlib
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from transformers import CLIPTextModel, CLIPTokenizer

log = logging.getLogger(__name__)

DEFAULTS = dict(
    pretrained="stabilityai/stable-diffusion-2-1-base",
    captions_csv="data/captions.csv",
    image_root="data/images",
    cache_dir="cache/latents",
    output_dir="runs/sd21-ft",
    resolution=512,
    batch_size=8,
    grad_accum=2,
    lr=2e-5,
    warmup=500,
    epochs=10,
    uncond_prob=0.1,
    ema_decay=0.9999,
    save_every=2000,
    encode_batch=32,
    workers=8,
    seed=0,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = cli.resume
    return argparse.Namespace(**cfg)


def read_captions(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [r["file"] for r in rows], [r["caption"] for r in rows]


@torch.no_grad()
def encode_latents(files, image_root, vae, resolution, batch_size, device):
    tf = transforms.Compose([
        transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(resolution),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])
    means, stds = [], []
    for i in range(0, len(files), batch_size):
        imgs = [tf(Image.open(os.path.join(image_root, fn)).convert("RGB")) for fn in files[i:i + batch_size]]
        x = torch.stack(imgs).to(device, dtype=vae.dtype)
        dist_ = vae.encode(x).latent_dist
        means.append(dist_.mean.cpu().half())
        stds.append(dist_.std.cpu().half())
    return {"mean": torch.cat(means), "std": torch.cat(stds)}


def get_latent_cache(cfg, files, vae, device):
    key = hashlib.md5(("|".join(files) + str(cfg.resolution)).encode()).hexdigest()[:12]
    cache_file = Path(cfg.cache_dir) / f"latents_{key}.pt"
    if cache_file.exists():
        log.info("loading latent cache %s", cache_file)
        return torch.load(cache_file, map_location="cpu")
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cache = encode_latents(files, cfg.image_root, vae, cfg.resolution, cfg.encode_batch, device)
    torch.save(cache, cache_file)
    log.info("encoded %d images in %.1fs -> %s", len(files), time.time() - t0, cache_file)
    return cache


class LatentCaptionDataset(Dataset):
    def __init__(self, cache, captions, tokenizer):
        self.mean, self.std = cache["mean"], cache["std"]
        self.captions = captions
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, i):
        ids = self.tokenizer(self.captions[i], padding="max_length", truncation=True,
                             max_length=self.tokenizer.model_max_length, return_tensors="pt").input_ids[0]
        return self.mean[i], self.std[i], ids


@torch.no_grad()
def update_ema(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p.detach(), 1.0 - decay)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(cfg.seed + rank)

    tokenizer = CLIPTokenizer.from_pretrained(cfg.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(cfg.pretrained, subfolder="text_encoder").to(device).eval()
    vae = AutoencoderKL.from_pretrained(cfg.pretrained, subfolder="vae").to(device).eval()
    unet = UNet2DConditionModel.from_pretrained(cfg.pretrained, subfolder="unet").to(device)
    sched = DDPMScheduler.from_pretrained(cfg.pretrained, subfolder="scheduler")
    text_encoder.requires_grad_(False)
    vae.requires_grad_(False)
    scaling = vae.config.scaling_factor

    files, captions = read_captions(cfg.captions_csv)
    cache = get_latent_cache(cfg, files, vae, device)
    del vae
    torch.cuda.empty_cache()

    with torch.no_grad():
        null_ids = tokenizer("", padding="max_length", max_length=tokenizer.model_max_length,
                             return_tensors="pt").input_ids.to(device)
        null_emb = text_encoder(null_ids)[0]

    ds = LatentCaptionDataset(cache, captions, tokenizer)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                    pin_memory=True, drop_last=True)

    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    unet.enable_gradient_checkpointing()
    unet.train()
    model = DDP(unet, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-2)
    steps_per_epoch = math.ceil(len(dl) / cfg.grad_accum)
    total_steps = steps_per_epoch * cfg.epochs
    lr_sched = get_scheduler("constant_with_warmup", opt, num_warmup_steps=cfg.warmup,
                             num_training_steps=total_steps)
    scaler = torch.cuda.amp.GradScaler()

    step, start_epoch = 0, 0
    if cfg.resume:
        ck = torch.load(cfg.resume, map_location="cpu")
        unet.load_state_dict(ck["unet"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        lr_sched.load_state_dict(ck["lr_sched"])
        scaler.load_state_dict(ck["scaler"])
        step, start_epoch = ck["step"], ck["epoch"] + 1
        log.info("resumed from %s at step %d", cfg.resume, step)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        for it, (mean, std, ids) in enumerate(dl):
            mean = mean.to(device, non_blocking=True).float()
            std = std.to(device, non_blocking=True).float()
            latents = (mean + std * torch.randn_like(mean)) * scaling
            with torch.no_grad():
                cond = text_encoder(ids.to(device, non_blocking=True))[0]
            drop = torch.rand(cond.shape[0], device=device) < cfg.uncond_prob
            cond = torch.where(drop[:, None, None], null_emb.expand_as(cond), cond)

            noise = torch.randn_like(latents)
            t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = sched.add_noise(latents, noise, t)
            target = sched.get_velocity(latents, noise, t) if sched.config.prediction_type == "v_prediction" else noise

            sync_now = (it + 1) % cfg.grad_accum == 0
            with torch.autocast("cuda", dtype=torch.float16):
                if sync_now:
                    pred = model(noisy, t, cond).sample
                    loss = F.mse_loss(pred.float(), target) / cfg.grad_accum
                    scaler.scale(loss).backward()
                else:
                    with model.no_sync():
                        pred = model(noisy, t, cond).sample
                        loss = F.mse_loss(pred.float(), target) / cfg.grad_accum
                        scaler.scale(loss).backward()
            if not sync_now:
                continue

            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            lr_sched.step()
            update_ema(ema, unet, cfg.ema_decay)
            step += 1

            if step % 100 == 0:
                l = loss.detach() * cfg.grad_accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, l.item(), lr_sched.get_last_lr()[0])

            if step % cfg.save_every == 0 and rank == 0:
                os.makedirs(cfg.output_dir, exist_ok=True)
                torch.save({"unet": unet.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                            "lr_sched": lr_sched.state_dict(), "scaler": scaler.state_dict(),
                            "step": step, "epoch": epoch},
                           os.path.join(cfg.output_dir, f"ckpt_{step:07d}.pt"))

    if rank == 0:
        ema.save_pretrained(os.path.join(cfg.output_dir, "unet_ema"))
        unet.save_pretrained(os.path.join(cfg.output_dir, "unet"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
