#!/usr/bin/env python
"""Fine-tune SD 2.1 (768, v-prediction) with a learned unconditional text embedding.

Instead of the CLIP embedding of "" the unconditional branch of classifier-free guidance uses a
trainable (77, 1024) tensor, initialised from the empty-prompt embedding.

torchrun --nnodes 1 --nproc_per_node 4 06_learned_null_text_cfg.py --data /data/product_shots --out runs/null-cfg
"""
import argparse
import copy
import glob
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
import wandb

from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer


class ImageTextFolder(Dataset):
    """kohya-style folder: foo.jpg + foo.txt"""

    def __init__(self, root, size=768):
        self.images = sorted(glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))
        self.tf = transforms.Compose([
            transforms.Resize(size, antialias=True),
            transforms.RandomCrop(size),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        path = self.images[i]
        with open(os.path.splitext(path)[0] + ".txt") as f:
            caption = f.read().strip()
        return self.tf(Image.open(path).convert("RGB")), caption


class GuidedUNet(nn.Module):
    def __init__(self, unet, null_init):
        super().__init__()
        self.unet = unet
        self.null_text = nn.Parameter(null_init.clone().float())

    def forward(self, x, t, text_emb, uncond_mask=None):
        if uncond_mask is not None and uncond_mask.any():
            text_emb = text_emb.clone()
            text_emb[uncond_mask] = self.null_text.to(text_emb.dtype)
        return self.unet(x, t, encoder_hidden_states=text_emb).sample


@torch.no_grad()
def sample(model, vae, text_encoder, tokenizer, prompts, device, steps=30, scale=6.0, seed=0):
    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                          beta_end=0.012, prediction_type="v_prediction", clip_sample=False, set_alpha_to_one=False)
    sched.set_timesteps(steps)
    ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    cond = text_encoder(ids.to(device))[0]
    uncond = model.null_text.expand_as(cond).to(cond.dtype)
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(len(prompts), 4, 96, 96, generator=g, device=device)
    for t in sched.timesteps:
        inp = torch.cat([x, x])
        tt = torch.full((inp.shape[0],), int(t), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.unet(inp, tt, encoder_hidden_states=torch.cat([uncond, cond])).sample.float()
        u, c = out.chunk(2)
        x = sched.step(u + scale * (c - u), t, x).prev_sample
    img = vae.decode(x / vae.config.scaling_factor).sample
    return ((img.clamp(-1, 1) + 1) / 2).cpu()


@torch.no_grad()
def ema_update(ema, model, decay=0.9999):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1.0 - decay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", default="stabilityai/stable-diffusion-2-1")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/null-cfg")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--null_lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--sample_prompts", nargs="+", default=["a ceramic mug on a wooden table, studio light"])
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)
    random.seed(1000 + rank)

    if rank == 0:
        wandb.init(project="null-text-cfg", config=vars(args))

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder").to(device).eval()
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae").to(device).eval()
    text_encoder.requires_grad_(False)
    vae.requires_grad_(False)
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet")
    noise_sched = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")

    with torch.no_grad():
        empty = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids
        null_init = text_encoder(empty.to(device))[0].cpu()

    model = GuidedUNet(unet, null_init).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    ddp = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW([
        {"params": model.unet.parameters(), "lr": args.lr},
        {"params": [model.null_text], "lr": args.null_lr, "weight_decay": 0.0},
    ], weight_decay=1e-2)

    ds = ImageTextFolder(args.data)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for pixels, captions in dl:
            pixels = pixels.to(device, non_blocking=True)
            with torch.no_grad():
                ids = tokenizer(list(captions), padding="max_length", max_length=77, truncation=True,
                                return_tensors="pt").input_ids.to(device)
                text_emb = text_encoder(ids)[0]
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
            uncond_mask = torch.rand(latents.shape[0], device=device) < args.p_uncond

            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_sched.add_noise(latents, noise, t)
            target = noise_sched.get_velocity(latents, noise, t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = ddp(noisy, t, text_emb, uncond_mask=uncond_mask)
            loss = F.mse_loss(pred.float(), target.float())

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            ema_update(ema, model)
            step += 1

            if step % 50 == 0:
                stats = torch.stack([loss.detach(), uncond_mask.float().mean()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": stats[0].item(), "uncond_frac": stats[1].item(), "epoch": epoch}, step=step)

            if step % args.save_every == 0:
                if rank == 0:
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out, f"ckpt_{step}.pt"))
                    imgs = sample(ema, vae, text_encoder, tokenizer, args.sample_prompts, device)
                    wandb.log({"samples": [wandb.Image(im) for im in imgs]}, step=step)
                dist.barrier()

    if rank == 0:
        ema.unet.save_pretrained(os.path.join(args.out, "unet_ema"))
        torch.save(ema.null_text.detach().cpu(), os.path.join(args.out, "null_text.pt"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
