#!/usr/bin/env python
# coding=utf-8
"""Text-to-image fine-tuning of SD 1.5 (adapted from diffusers' train_text_to_image.py),
moved from accelerate/DDP to plain torch FSDP so the UNet + AdamW states fit at 768px.

torchrun --nproc_per_node 4 06_sd15_t2i_fsdp_ema.py --dataset_name lambdalabs/naruto-blip-captions \
    --resolution 768 --train_batch_size 6 --use_ema --output_dir sd15-naruto
"""
import argparse
import functools
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.models.unets.unet_2d_blocks import (
    CrossAttnDownBlock2D,
    CrossAttnUpBlock2D,
    DownBlock2D,
    UNetMidBlock2DCrossAttn,
    UpBlock2D,
)
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrained_model_name_or_path", default="runwayml/stable-diffusion-v1-5")
    parser.add_argument("--dataset_name", required=True)
    parser.add_argument("--image_column", default="image")
    parser.add_argument("--caption_column", default="text")
    parser.add_argument("--output_dir", default="sd-model-finetuned")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--num_train_epochs", type=int, default=50)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--lr_scheduler", default="constant_with_warmup")
    parser.add_argument("--lr_warmup_steps", type=int, default=500)
    parser.add_argument("--use_ema", action="store_true")
    parser.add_argument("--ema_decay", type=float, default=0.9999)
    parser.add_argument("--snr_gamma", type=float, default=5.0)
    parser.add_argument("--checkpointing_epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def compute_snr(noise_scheduler, timesteps):
    alphas_cumprod = noise_scheduler.alphas_cumprod.to(timesteps.device)
    alpha = alphas_cumprod[timesteps] ** 0.5
    sigma = (1.0 - alphas_cumprod[timesteps]) ** 0.5
    return (alpha / sigma) ** 2


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    global_rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed + global_rank)

    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    vae.to(device, dtype=torch.float16)
    text_encoder.to(device, dtype=torch.float16)

    if args.use_ema:
        ema_unet = EMAModel(unet.parameters(), decay=args.ema_decay, model_cls=UNet2DConditionModel,
                            model_config=unet.config)
        ema_unet.to(device)

    unet.enable_gradient_checkpointing()
    wrap_policy = ModuleWrapPolicy({CrossAttnDownBlock2D, DownBlock2D, UNetMidBlock2DCrossAttn,
                                    CrossAttnUpBlock2D, UpBlock2D})
    unet = FSDP(
        unet,
        auto_wrap_policy=wrap_policy,
        mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=device,
        use_orig_params=True,
    )
    scaler = torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler()

    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=1e-2, eps=1e-8)

    dataset = load_dataset(args.dataset_name, split="train")
    train_transforms = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])

    def preprocess(examples):
        images = [im.convert("RGB") for im in examples[args.image_column]]
        examples["pixel_values"] = [train_transforms(im) for im in images]
        examples["input_ids"] = tokenizer(examples[args.caption_column], max_length=tokenizer.model_max_length,
                                          padding="max_length", truncation=True, return_tensors="pt").input_ids
        return examples

    dataset = dataset.with_transform(preprocess)

    def collate_fn(examples):
        pixel_values = torch.stack([e["pixel_values"] for e in examples]).float()
        input_ids = torch.stack([e["input_ids"] for e in examples])
        return {"pixel_values": pixel_values, "input_ids": input_ids}

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=global_rank, shuffle=True, seed=args.seed)
    train_dataloader = DataLoader(dataset, sampler=sampler, collate_fn=collate_fn,
                                  batch_size=args.train_batch_size, num_workers=4, drop_last=True)
    max_train_steps = args.num_train_epochs * len(train_dataloader)
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_train_steps)

    if global_rank == 0:
        print(f"  Num examples = {len(dataset)}")
        print(f"  Total train batch size = {args.train_batch_size * world_size}")
        print(f"  Total optimization steps = {max_train_steps}")

    global_step = 0
    for epoch in range(args.num_train_epochs):
        unet.train()
        sampler.set_epoch(epoch)
        epoch_loss = torch.zeros((), device=device)
        for batch in train_dataloader:
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=torch.float16)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(batch["input_ids"].to(device), return_dict=False)[0]

            noise = torch.randn_like(latents)
            bsz = latents.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0] / snr
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="none")
            loss = (loss.mean(dim=list(range(1, loss.ndim))) * mse_loss_weights).mean()

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            unet.clip_grad_norm_(1.0)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            if args.use_ema:
                ema_unet.step(unet.parameters())
            global_step += 1
            epoch_loss += loss.detach()

            if global_rank == 0 and global_step % 50 == 0:
                print(f"epoch {epoch} step {global_step} loss {loss.item():.4f} lr {lr_scheduler.get_last_lr()[0]:.3e}")

        dist.all_reduce(epoch_loss, op=dist.ReduceOp.SUM)
        if global_rank == 0:
            print(f"epoch {epoch} mean loss {epoch_loss.item() / (world_size * len(train_dataloader)):.4f}")

        if (epoch + 1) % args.checkpointing_epochs == 0 or epoch == args.num_train_epochs - 1:
            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(unet, StateDictType.FULL_STATE_DICT, cfg):
                unet_sd = unet.state_dict()
            if global_rank == 0:
                save_dir = os.path.join(args.output_dir, f"checkpoint-epoch{epoch + 1}")
                os.makedirs(save_dir, exist_ok=True)
                torch.save(unet_sd, os.path.join(save_dir, "unet.pt"))
                if args.use_ema:
                    ema_unet.save_pretrained(os.path.join(save_dir, "unet_ema"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
