#!/usr/bin/env python
# Fine-tune a Stable-Diffusion-style latent UNet on an image/caption dataset with accelerate.
#
#   accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 07_ldm_text2img_accelerate.py \
#       --pretrained_model_name_or_path stabilityai/stable-diffusion-2-1-base \
#       --dataset_name lambdalabs/naruto-blip-captions --output_dir sd-naruto
import argparse
import logging
import math
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from datasets import load_dataset
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

logger = get_logger(__name__, log_level="INFO")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained_model_name_or_path", required=True)
    p.add_argument("--dataset_name", required=True)
    p.add_argument("--image_column", default="image")
    p.add_argument("--caption_column", default="text")
    p.add_argument("--output_dir", default="sd-finetune")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=15000)
    p.add_argument("--learning_rate", type=float, default=1e-5)
    p.add_argument("--scale_lr", action="store_true")
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--caption_dropout", type=float, default=0.1)
    p.add_argument("--snr_gamma", type=float, default=None)
    p.add_argument("--use_ema", action="store_true")
    p.add_argument("--checkpointing_steps", type=int, default=2500)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--dataloader_num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed, device_specific=True)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()

    ema_unet = None
    if args.use_ema:
        ema_unet = EMAModel(unet.parameters(), model_cls=UNet2DConditionModel, model_config=unet.config)

    if args.scale_lr:
        args.learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * accelerator.num_processes
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.learning_rate, weight_decay=1e-2)

    dataset = load_dataset(args.dataset_name)["train"]
    train_tf = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.RandomCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])

    def tokenize(captions):
        return tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length",
                         truncation=True, return_tensors="pt").input_ids

    def preprocess(examples):
        examples["pixel_values"] = [train_tf(im.convert("RGB")) for im in examples[args.image_column]]
        caps = []
        for c in examples[args.caption_column]:
            c = random.choice(c) if isinstance(c, (list, tuple)) else c
            # empty caption = unconditional sample for classifier-free guidance
            caps.append("" if random.random() < args.caption_dropout else c)
        examples["input_ids"] = tokenize(caps)
        return examples

    with accelerator.main_process_first():
        dataset = dataset.shuffle(seed=args.seed).with_transform(preprocess)

    def collate(examples):
        return {
            "pixel_values": torch.stack([e["pixel_values"] for e in examples]).contiguous().float(),
            "input_ids": torch.stack([e["input_ids"] for e in examples]),
        }

    train_dataloader = torch.utils.data.DataLoader(dataset, shuffle=True, collate_fn=collate,
                                                   batch_size=args.train_batch_size,
                                                   num_workers=args.dataloader_num_workers)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)
    unet, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(unet, optimizer, train_dataloader, lr_scheduler)

    weight_dtype = torch.float32
    if accelerator.mixed_precision == "fp16":
        weight_dtype = torch.float16
    elif accelerator.mixed_precision == "bf16":
        weight_dtype = torch.bfloat16
    text_encoder.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    if ema_unet is not None:
        ema_unet.to(accelerator.device)

    if accelerator.is_main_process:
        accelerator.init_trackers("sd-finetune", config=vars(args))

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    num_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    total_bs = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"  Num examples = {len(dataset)}, total batch size = {total_bs}, epochs = {num_epochs}")

    global_step = 0
    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    for epoch in range(num_epochs):
        unet.train()
        train_loss = 0.0
        for batch in train_dataloader:
            with accelerator.accumulate(unet):
                latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                bsz = latents.shape[0]
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device)
                noisy = noise_scheduler.add_noise(latents, noise, timesteps)
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                if noise_scheduler.config.prediction_type == "v_prediction":
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                else:
                    target = noise

                model_pred = unet(noisy, timesteps, encoder_hidden_states, return_dict=False)[0]
                if args.snr_gamma is None:
                    loss = F.mse_loss(model_pred.float(), target.float())
                else:
                    abar = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps]
                    snr = abar / (1 - abar)
                    w = torch.clamp(snr, max=args.snr_gamma) / snr
                    if noise_scheduler.config.prediction_type == "v_prediction":
                        w = w * snr / (snr + 1)
                    loss = (F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3)) * w).mean()

                avg_loss = accelerator.gather(loss.repeat(bsz)).mean()
                train_loss += avg_loss.item() / args.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                if ema_unet is not None:
                    ema_unet.step(unet.parameters())
                progress_bar.update(1)
                global_step += 1
                accelerator.log({"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)
                train_loss = 0.0

                if global_step % args.checkpointing_steps == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{global_step}"))

            if global_step >= args.max_train_steps:
                break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final_unet = accelerator.unwrap_model(unet)
        if ema_unet is not None:
            ema_unet.copy_to(final_unet.parameters())
        final_unet.save_pretrained(os.path.join(args.output_dir, "unet"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
