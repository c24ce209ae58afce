#!/usr/bin/env python
# ControlNet (canny) training on SD1.5, hand-rolled DDP loop (the accelerate version fought with
# our cluster's launcher). Frozen VAE / CLIP live in a small helper shared with the notebook code.
#
#   torchrun --nproc_per_node=8 20_controlnet_canny_ddp.py --data_root /data/laion_art_canny --out ckpt/cn_canny
import argparse
import json
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers import AutoencoderKL, ControlNetModel, DDPMScheduler, UNet2DConditionModel

SD = "runwayml/stable-diffusion-v1-5"


class FrozenEncoders:
    """VAE + CLIP text encoder, inference only (same helper as notebooks/preview.ipynb)."""

    def __init__(self, model_id, device="cuda:0", dtype=torch.float16):
        self.device, self.dtype = device, dtype
        self.tokenizer = CLIPTokenizer.from_pretrained(model_id, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(model_id, subfolder="text_encoder", torch_dtype=dtype)
        self.vae = AutoencoderKL.from_pretrained(model_id, subfolder="vae", torch_dtype=dtype)
        self.text_encoder.to(device).eval().requires_grad_(False)
        self.vae.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def encode_text(self, captions):
        ids = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(self.device)
        return self.text_encoder(ids)[0]

    @torch.no_grad()
    def encode_image(self, pixels):
        pixels = pixels.to(self.device, self.dtype)
        return self.vae.encode(pixels).latent_dist.sample() * self.vae.config.scaling_factor


class CannyPairs(Dataset):
    def __init__(self, root, size=512, drop_caption=0.05):
        self.root = root
        self.rows = [json.loads(l) for l in open(os.path.join(root, "prompt.jsonl"))]
        self.size = size
        self.drop_caption = drop_caption
        self.img_tf = transforms.Compose([
            transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor(), transforms.Normalize([0.5], [0.5])
        ])
        self.cond_tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.root, r["target"])).convert("RGB")
        if "source" in r:
            hint = Image.open(os.path.join(self.root, r["source"])).convert("RGB")
        else:
            edges = cv2.Canny(np.array(img), 100, 200)
            hint = Image.fromarray(np.stack([edges] * 3, -1))
        caption = "" if random.random() < self.drop_caption else r["prompt"]
        return {"pixel_values": self.img_tf(img), "cond": self.cond_tf(hint), "caption": caption}


def collate(b):
    return {
        "pixel_values": torch.stack([x["pixel_values"] for x in b]),
        "cond": torch.stack([x["cond"] for x in b]),
        "captions": [x["caption"] for x in b],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--save_steps", type=int, default=5000)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)

    enc = FrozenEncoders(SD)
    unet = UNet2DConditionModel.from_pretrained(SD, subfolder="unet", torch_dtype=torch.float16).to(device)
    unet.requires_grad_(False)
    if args.resume:
        controlnet = ControlNetModel.from_pretrained(args.resume)
    else:
        controlnet = ControlNetModel.from_unet(UNet2DConditionModel.from_pretrained(SD, subfolder="unet"))
    controlnet.enable_gradient_checkpointing()
    controlnet.to(device).train()
    cn = DDP(controlnet, device_ids=[local_rank])
    noise_sched = DDPMScheduler.from_pretrained(SD, subfolder="scheduler")

    ds = CannyPairs(args.data_root)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, collate_fn=collate, drop_last=True,
                    pin_memory=True)
    opt = torch.optim.AdamW(controlnet.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} pairs, {len(dl)} it/epoch/rank, world {world}", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in dl:
            latents = enc.encode_image(batch["pixel_values"]).to(device)
            text_emb = enc.encode_text(batch["captions"]).to(device)
            cond = batch["cond"].to(device)

            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.shape[0],), device=device).long()
            noisy = noise_sched.add_noise(latents, noise, t)

            with torch.autocast("cuda", dtype=torch.float16):
                down, mid = cn(noisy, t, encoder_hidden_states=text_emb, controlnet_cond=cond, return_dict=False)
                pred = unet(noisy, t, encoder_hidden_states=text_emb,
                            down_block_additional_residuals=down, mid_block_additional_residual=mid).sample
            loss = F.mse_loss(pred.float(), noise.float())

            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f}", flush=True)
            if step % args.save_steps == 0:
                if rank == 0:
                    controlnet.save_pretrained(os.path.join(args.out, f"step_{step}"))
                dist.barrier()

    if rank == 0:
        controlnet.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
