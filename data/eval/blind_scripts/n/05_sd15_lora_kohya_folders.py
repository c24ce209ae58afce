#!/usr/bin/env python
# SD1.5 LoRA trainer that reads kohya-style dataset folders ("<repeats>_<name>/img.png + img.txt")
# but trains with diffusers + peft so the output loads straight into diffusers pipelines.
#
#   accelerate launch --config_file configs/4gpu.yaml 05_sd15_lora_kohya_folders.py \
#       --pretrained_model runwayml/stable-diffusion-v1-5 --train_data_dir ./train_imgs --output_dir ./lora_out
import argparse
import logging
import math
import os
import random
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.utils import convert_state_dict_to_diffusers

logger = get_logger(__name__, log_level="INFO")
IMG_EXT = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained_model", required=True)
    ap.add_argument("--train_data_dir", required=True)
    ap.add_argument("--output_dir", default="lora_out")
    ap.add_argument("--output_name", default="my_lora")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--train_batch_size", type=int, default=2)
    ap.add_argument("--max_train_epochs", type=int, default=10)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=1)
    ap.add_argument("--unet_lr", type=float, default=1e-4)
    ap.add_argument("--network_dim", type=int, default=32)
    ap.add_argument("--network_alpha", type=float, default=16)
    ap.add_argument("--lr_scheduler", default="cosine")
    ap.add_argument("--lr_warmup_steps", type=int, default=100)
    ap.add_argument("--mixed_precision", default="bf16")
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--noise_offset", type=float, default=0.0)
    ap.add_argument("--save_every_n_epochs", type=int, default=2)
    ap.add_argument("--sample_prompts", default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max_data_loader_n_workers", type=int, default=4)
    ap.add_argument("--log_with", default="tensorboard")
    return ap.parse_args()


class KohyaFolderDataset(Dataset):
    def __init__(self, root, tokenizer, resolution):
        self.samples = []
        for sub in sorted(Path(root).iterdir()):
            if not sub.is_dir():
                continue
            m = re.match(r"^(\d+)_(.+)$", sub.name)
            if not m:
                logger.warning(f"ignoring folder {sub.name} (no repeat prefix)")
                continue
            repeats, class_tokens = int(m.group(1)), m.group(2)
            for img in sorted(sub.iterdir()):
                if img.suffix.lower() not in IMG_EXT:
                    continue
                cap_file = img.with_suffix(".txt")
                caption = cap_file.read_text(encoding="utf-8").strip() if cap_file.exists() else class_tokens
                self.samples.extend([(str(img), caption)] * repeats)
        self.tokenizer = tokenizer
        self.tf = transforms.Compose(
            [
                transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR),
                transforms.RandomCrop(resolution),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize([0.5], [0.5]),
            ]
        )

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        path, caption = self.samples[idx]
        img = Image.open(path).convert("RGB")
        tags = [t.strip() for t in caption.split(",")]
        if len(tags) > 2:  # shuffle_caption, keep first tag
            rest = tags[1:]
            random.shuffle(rest)
            tags = tags[:1] + rest
        ids = self.tokenizer(", ".join(tags), max_length=self.tokenizer.model_max_length, padding="max_length",
                             truncation=True, return_tensors="pt").input_ids[0]
        return {"pixel_values": self.tf(img), "input_ids": ids}


def sample_images(accelerator, args, unet, text_encoder, vae, tokenizer, epoch, weight_dtype):
    if not args.sample_prompts or not os.path.exists(args.sample_prompts):
        return
    prompts = [l.strip() for l in open(args.sample_prompts) if l.strip()]
    pipe = StableDiffusionPipeline.from_pretrained(
        args.pretrained_model, unet=accelerator.unwrap_model(unet), text_encoder=text_encoder, vae=vae,
        tokenizer=tokenizer, safety_checker=None, torch_dtype=weight_dtype,
    ).to(accelerator.device)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator(device=accelerator.device).manual_seed(args.seed)
    out_dir = os.path.join(args.output_dir, "sample")
    os.makedirs(out_dir, exist_ok=True)
    with torch.autocast("cuda", dtype=weight_dtype):
        for i, p in enumerate(prompts):
            img = pipe(p, num_inference_steps=28, generator=gen).images[0]
            img.save(os.path.join(out_dir, f"{args.output_name}_e{epoch:04d}_{i:02d}.png"))
    del pipe
    torch.cuda.empty_cache()


def save_lora(accelerator, unet, args, name):
    lora_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(accelerator.unwrap_model(unet)))
    StableDiffusionPipeline.save_lora_weights(os.path.join(args.output_dir, name), unet_lora_layers=lora_sd,
                                              safe_serialization=True)


def main():
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=args.log_with,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "logs")),
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model, subfolder="scheduler")

    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)

    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)
    unet.to(accelerator.device, dtype=weight_dtype)
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)

    unet.add_adapter(LoraConfig(r=args.network_dim, lora_alpha=args.network_alpha, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()

    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=1e-2)

    dataset = KohyaFolderDataset(args.train_data_dir, tokenizer, args.resolution)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True,
                        num_workers=args.max_data_loader_n_workers, persistent_workers=True, drop_last=True)

    steps_per_epoch = math.ceil(len(loader) / accelerator.num_processes / args.gradient_accumulation_steps)
    max_train_steps = steps_per_epoch * args.max_train_epochs
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=max_train_steps * accelerator.num_processes)

    unet, optimizer, loader, lr_scheduler = accelerator.prepare(unet, optimizer, loader, lr_scheduler)

    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    max_train_steps = steps_per_epoch * args.max_train_epochs
    if accelerator.is_main_process:
        accelerator.init_trackers("network_train", config=vars(args))
    logger.info(f"num train images * repeats: {len(dataset)}, processes: {accelerator.num_processes}, "
                f"steps: {max_train_steps}")

    progress = tqdm(range(max_train_steps), disable=not accelerator.is_local_main_process, desc="steps")
    global_step = 0
    for epoch in range(args.max_train_epochs):
        unet.train()
        loss_sum, loss_n = 0.0, 0
        for batch in loader:
            with accelerator.accumulate(unet):
                with torch.no_grad():
                    latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
                    latents = latents * vae.config.scaling_factor
                    enc = text_encoder(batch["input_ids"])[0]
                noise = torch.randn_like(latents)
                if args.noise_offset:
                    noise += args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1),
                                                             device=latents.device, dtype=latents.dtype)
                t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                  device=latents.device).long()
                noisy = noise_scheduler.add_noise(latents, noise, t)
                pred = unet(noisy, t, enc).sample
                target = noise if noise_scheduler.config.prediction_type == "epsilon" \
                    else noise_scheduler.get_velocity(latents, noise, t)
                loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            if accelerator.sync_gradients:
                progress.update(1)
                global_step += 1
                avg = accelerator.gather(loss.detach()).mean().item()
                loss_sum += avg
                loss_n += 1
                accelerator.log({"loss/current": avg, "loss/average": loss_sum / loss_n,
                                 "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)
                progress.set_postfix(loss=avg)

        accelerator.wait_for_everyone()
        if (epoch + 1) % args.save_every_n_epochs == 0 and epoch + 1 < args.max_train_epochs:
            if accelerator.is_main_process:
                save_lora(accelerator, unet, args, f"{args.output_name}-{epoch + 1:06d}")
                sample_images(accelerator, args, unet, text_encoder, vae, tokenizer, epoch + 1, weight_dtype)
            accelerator.wait_for_everyone()

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_lora(accelerator, unet, args, args.output_name)
        sample_images(accelerator, args, unet, text_encoder, vae, tokenizer, args.max_train_epochs, weight_dtype)
    accelerator.end_training()


if __name__ == "__main__":
    main()
