#!/usr/bin/env python
"""Anime-style LoRA for SD 1.5 (DDP). Images are encoded to latents inside the dataset so the
training loop only ever sees latents and text ids.

torchrun --nproc_per_node 8 15_onthefly_latent_dataset.py --images /data/anime/images --tags /data/anime/tags.csv
"""
import argparse
import csv
import logging
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.utils import convert_state_dict_to_diffusers
from diffusers import StableDiffusionPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer

log = logging.getLogger("anime_lora")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runwayml/stable-diffusion-v1-5")
    ap.add_argument("--images", required=True)
    ap.add_argument("--tags", required=True, help="csv with columns: file,tags")
    ap.add_argument("--out", default="runs/anime-lora")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--tag_dropout", type=float, default=0.1)
    ap.add_argument("--shuffle_tags", action="store_true")
    ap.add_argument("--empty_prompt_prob", type=float, default=0.1)
    ap.add_argument("--save_every_epochs", type=int, default=1)
    return ap.parse_args()


class LatentTagDataset(Dataset):
    """Returns (latent, input_ids). The VAE lives on this rank's GPU."""

    def __init__(self, image_dir, tags_csv, tokenizer, vae, device, args, size=512):
        with open(tags_csv, newline="") as f:
            self.rows = [(r["file"], r["tags"]) for r in csv.DictReader(f)]
        self.image_dir = image_dir
        self.tokenizer = tokenizer
        self.vae = vae
        self.device = device
        self.args = args
        self.tf = transforms.Compose([
            transforms.Resize(size, interpolation=transforms.InterpolationMode.LANCZOS),
            transforms.CenterCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.rows)

    def make_caption(self, tags):
        tags = [t.strip().replace("_", " ") for t in tags.split(",") if t.strip()]
        tags = [t for t in tags if random.random() >= self.args.tag_dropout]
        if self.args.shuffle_tags:
            random.shuffle(tags)
        if random.random() < self.args.empty_prompt_prob:
            return ""
        return ", ".join(tags)

    @torch.no_grad()
    def __getitem__(self, idx):
        fname, tags = self.rows[idx]
        pixels = self.tf(Image.open(os.path.join(self.image_dir, fname)).convert("RGB"))
        pixels = pixels.unsqueeze(0).to(self.device, dtype=self.vae.dtype)
        latent = self.vae.encode(pixels).latent_dist.sample()[0] * self.vae.config.scaling_factor
        ids = self.tokenizer(self.make_caption(tags), padding="max_length", truncation=True,
                             max_length=self.tokenizer.model_max_length, return_tensors="pt").input_ids[0]
        return latent.float().cpu(), ids


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(rank)
    torch.manual_seed(rank)
    tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    tokenizer = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.float16)
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.float16)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet", torch_dtype=torch.float16)
    noise_scheduler = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False)
        m.to(device)

    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank // 2, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]))
    lora_params = [p for p in unet.parameters() if p.requires_grad]
    for p in lora_params:
        p.data = p.data.float()
    ddp_unet = DDP(unet, device_ids=[local_rank])

    dataset = LatentTagDataset(args.images, args.tags, tokenizer, vae, device, args)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        drop_last=True, persistent_workers=True, prefetch_factor=4)

    optimizer = torch.optim.AdamW(lora_params, lr=args.lr, weight_decay=1e-2)
    total_steps = args.epochs * len(loader)
    lr_scheduler = get_scheduler("cosine_with_restarts", optimizer, num_warmup_steps=200,
                                 num_training_steps=total_steps, num_cycles=2)
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_unet.train()
        t0 = time.time()
        for latents, ids in loader:
            latents, ids = latents.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            with torch.no_grad():
                cond = text_encoder(ids)[0]
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_scheduler.add_noise(latents, noise, t)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = ddp_unet(noisy, t, cond).sample
            loss = F.mse_loss(pred.float(), noise)

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(lora_params, 1.0)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                m = torch.stack([loss.detach(), gnorm.detach().float()])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tb.add_scalar("loss", m[0].item(), step)
                    tb.add_scalar("grad_norm", m[1].item(), step)
                    tb.add_scalar("lr", lr_scheduler.get_last_lr()[0], step)

        if rank == 0:
            log.info("epoch %d done in %.0fs", epoch, time.time() - t0)
            if (epoch + 1) % args.save_every_epochs == 0:
                lora_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(ddp_unet.module))
                StableDiffusionPipeline.save_lora_weights(os.path.join(args.out, f"epoch-{epoch + 1:03d}"),
                                                          unet_lora_layers=lora_sd)
        dist.barrier()

    if rank == 0:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
