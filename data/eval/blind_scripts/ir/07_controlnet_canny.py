"""Train a canny-edge ControlNet on top of a frozen SD 1.5.

torchrun --nproc_per_node=8 07_controlnet_canny.py --data_dir /data/laion-art-canny --output_dir runs/cn-canny
"""
import argparse
import json
import logging
import math
import os
import random

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import (AutoencoderKL, ControlNetModel, DDPMScheduler, StableDiffusionControlNetPipeline,
                       UNet2DConditionModel, UniPCMultistepScheduler)
from diffusers.optimization import get_scheduler
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained_model_name_or_path", default="runwayml/stable-diffusion-v1-5")
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", default="runs/controlnet")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--proportion_empty_prompts", type=float, default=0.5)
    parser.add_argument("--checkpointing_steps", type=int, default=2000)
    parser.add_argument("--validation_image", default=None)
    parser.add_argument("--validation_prompt", default="a red sports car on a mountain road")
    parser.add_argument("--seed", type=int, default=2024)
    return parser.parse_args()


class CannyDataset(Dataset):
    def __init__(self, data_dir, tokenizer, resolution, proportion_empty_prompts):
        with open(os.path.join(data_dir, "train.jsonl")) as f:
            self.records = [json.loads(line) for line in f]
        self.data_dir = data_dir
        self.tokenizer = tokenizer
        self.p_empty = proportion_empty_prompts
        self.image_tf = transforms.Compose([
            transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(resolution),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])
        self.cond_tf = transforms.Compose([
            transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.CenterCrop(resolution),
            transforms.ToTensor(),
        ])

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        image = Image.open(os.path.join(self.data_dir, rec["image"])).convert("RGB")
        edges = cv2.Canny(np.array(image), 100, 200)
        cond = Image.fromarray(np.stack([edges] * 3, axis=-1))
        prompt = "" if random.random() < self.p_empty else rec["text"]
        input_ids = self.tokenizer(prompt, max_length=self.tokenizer.model_max_length, padding="max_length",
                                   truncation=True, return_tensors="pt").input_ids[0]
        return {"pixel_values": self.image_tf(image), "conditioning_pixel_values": self.cond_tf(cond),
                "input_ids": input_ids}


def save_checkpoint(controlnet, optimizer, lr_scheduler, step, output_dir):
    ckpt_dir = os.path.join(output_dir, f"checkpoint-{step}")
    os.makedirs(ckpt_dir, exist_ok=True)
    controlnet.save_pretrained(os.path.join(ckpt_dir, "controlnet"))
    torch.save({"optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(), "step": step},
               os.path.join(ckpt_dir, "training_state.pt"))
    logger.info("Saved state to %s", ckpt_dir)


@torch.no_grad()
def log_validation(args, vae, text_encoder, tokenizer, unet, controlnet, device, step):
    pipeline = StableDiffusionControlNetPipeline.from_pretrained(
        args.pretrained_model_name_or_path, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        unet=unet, controlnet=controlnet, safety_checker=None, torch_dtype=torch.float16,
    ).to(device)
    pipeline.scheduler = UniPCMultistepScheduler.from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    image = Image.open(args.validation_image).convert("RGB").resize((args.resolution, args.resolution))
    edges = cv2.Canny(np.array(image), 100, 200)
    control = Image.fromarray(np.stack([edges] * 3, axis=-1))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    with torch.autocast("cuda", dtype=torch.float16):
        outs = pipeline([args.validation_prompt] * 4, image=control, num_inference_steps=20,
                        generator=generator).images
    os.makedirs(os.path.join(args.output_dir, "validation"), exist_ok=True)
    for i, im in enumerate(outs):
        im.save(os.path.join(args.output_dir, "validation", f"{step:07d}_{i}.png"))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    controlnet = ControlNetModel.from_unet(unet)

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.requires_grad_(False)
    vae.to(device, dtype=torch.float16)
    text_encoder.to(device, dtype=torch.float16)
    unet.to(device, dtype=torch.float16)
    controlnet.to(device)
    controlnet.train()
    controlnet = DistributedDataParallel(controlnet, device_ids=[local_rank], output_device=local_rank)

    dataset = CannyDataset(args.data_dir, tokenizer, args.resolution, args.proportion_empty_prompts)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=args.learning_rate, weight_decay=1e-2)
    max_train_steps = args.num_train_epochs * len(loader)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=500,
                                 num_training_steps=max_train_steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        logger.info("***** Running training *****")
        logger.info("  Num examples = %d", len(dataset))
        logger.info("  Per-device batch = %d, world size = %d", args.train_batch_size, world_size)
        logger.info("  Total optimization steps = %d", max_train_steps)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            pixel_values = batch["pixel_values"].to(device, dtype=torch.float16, non_blocking=True)
            cond_image = batch["conditioning_pixel_values"].to(device, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(input_ids)[0]
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

            with torch.autocast("cuda", dtype=torch.float16):
                down_res, mid_res = controlnet(noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                                               controlnet_cond=cond_image, return_dict=False)
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                                  down_block_additional_residuals=[r.to(torch.float16) for r in down_res],
                                  mid_block_additional_residual=mid_res.to(torch.float16)).sample
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 100 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                if rank == 0:
                    logger.info("epoch %d step %d loss %.4f", epoch, global_step, reduced.item())

            if global_step % args.checkpointing_steps == 0:
                if rank == 0:
                    save_checkpoint(controlnet, optimizer, lr_scheduler, global_step, args.output_dir)
                    if args.validation_image:
                        log_validation(args, vae, text_encoder, tokenizer, unet, controlnet.module, device, global_step)
                dist.barrier()

    if rank == 0:
        controlnet.module.save_pretrained(os.path.join(args.output_dir, "controlnet"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
