#!/usr/bin/env python
"""Textual inversion for SD 1.5: learn one new token embedding (<my-style>) from a few images.

torchrun --nproc_per_node 4 12_textual_inversion_ddp.py --train_data_dir data/watercolor \
    --placeholder_token "<wc-style>" --initializer_token watercolor --output_dir out/ti-watercolor
"""
import argparse
import logging
import math
import os
import random

import numpy as np
import PIL
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger("textual_inversion")

STYLE_TEMPLATES = [
    "a painting in the style of {}",
    "a rendering in the style of {}",
    "a cropped painting in the style of {}",
    "the painting in the style of {}",
    "a clean painting in the style of {}",
    "a close-up painting in the style of {}",
    "a good painting in the style of {}",
    "a small painting in the style of {}",
    "a large painting in the style of {}",
    "a nice painting in the style of {}",
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained_model_name_or_path", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--placeholder_token", required=True)
    p.add_argument("--initializer_token", required=True)
    p.add_argument("--output_dir", default="out/ti")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--max_train_steps", type=int, default=3000)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--save_steps", type=int, default=500)
    p.add_argument("--validation_steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TextualInversionDataset(Dataset):
    def __init__(self, data_root, tokenizer, placeholder_token, size=512, repeats=100):
        self.image_paths = [os.path.join(data_root, f) for f in sorted(os.listdir(data_root))
                            if f.lower().endswith((".png", ".jpg", ".jpeg"))]
        self.tokenizer = tokenizer
        self.placeholder_token = placeholder_token
        self.size = size
        self._length = len(self.image_paths) * repeats
        self.flip = transforms.RandomHorizontalFlip(p=0.5)

    def __len__(self):
        return self._length

    def __getitem__(self, i):
        image = Image.open(self.image_paths[i % len(self.image_paths)]).convert("RGB")
        text = random.choice(STYLE_TEMPLATES).format(self.placeholder_token)
        input_ids = self.tokenizer(text, padding="max_length", truncation=True,
                                   max_length=self.tokenizer.model_max_length, return_tensors="pt").input_ids[0]
        img = np.array(image).astype(np.uint8)
        crop = min(img.shape[0], img.shape[1])
        h, w = img.shape[0], img.shape[1]
        img = img[(h - crop) // 2:(h + crop) // 2, (w - crop) // 2:(w + crop) // 2]
        image = Image.fromarray(img).resize((self.size, self.size), resample=PIL.Image.Resampling.BICUBIC)
        image = self.flip(image)
        pixel_values = torch.from_numpy((np.array(image).astype(np.float32) / 127.5 - 1.0)).permute(2, 0, 1)
        return {"pixel_values": pixel_values, "input_ids": input_ids}


def save_progress(text_encoder, placeholder_token_id, placeholder_token, save_path):
    learned = text_encoder.get_input_embeddings().weight[placeholder_token_id].detach().cpu()
    save_file({placeholder_token: learned.unsqueeze(0)}, save_path)
    logger.info("saved learned embedding to %s", save_path)


@torch.no_grad()
def log_validation(args, text_encoder, tokenizer, unet, vae, device, step):
    pipe = StableDiffusionPipeline.from_pretrained(args.pretrained_model_name_or_path, text_encoder=text_encoder,
                                                   tokenizer=tokenizer, unet=unet, vae=vae, safety_checker=None,
                                                   torch_dtype=torch.bfloat16).to(device)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator(device=device).manual_seed(args.seed)
    prompt = f"a lighthouse in the style of {args.placeholder_token}"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        images = pipe([prompt] * 4, num_inference_steps=25, generator=g).images
    os.makedirs(os.path.join(args.output_dir, "val"), exist_ok=True)
    for i, im in enumerate(images):
        im.save(os.path.join(args.output_dir, "val", f"{step:05d}_{i}.png"))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model_name_or_path, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model_name_or_path, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model_name_or_path, subfolder="scheduler")

    if tokenizer.add_tokens(args.placeholder_token) == 0:
        raise ValueError(f"tokenizer already contains {args.placeholder_token}")
    init_ids = tokenizer.encode(args.initializer_token, add_special_tokens=False)
    if len(init_ids) != 1:
        raise ValueError("initializer token must be a single token")
    placeholder_token_id = tokenizer.convert_tokens_to_ids(args.placeholder_token)
    text_encoder.resize_token_embeddings(len(tokenizer))
    token_embeds = text_encoder.get_input_embeddings().weight.data
    token_embeds[placeholder_token_id] = token_embeds[init_ids[0]].clone()

    vae.requires_grad_(False)
    unet.requires_grad_(False)
    text_encoder.text_model.encoder.requires_grad_(False)
    text_encoder.text_model.final_layer_norm.requires_grad_(False)
    text_encoder.text_model.embeddings.position_embedding.requires_grad_(False)

    vae.to(device, dtype=torch.bfloat16)
    unet.to(device, dtype=torch.bfloat16)
    text_encoder.to(device)
    text_encoder = DDP(text_encoder, device_ids=[local_rank])
    orig_embeds = text_encoder.module.get_input_embeddings().weight.data.clone()

    lr = args.learning_rate * args.train_batch_size * world_size
    optimizer = torch.optim.AdamW(text_encoder.module.get_input_embeddings().parameters(), lr=lr,
                                  betas=(0.9, 0.999), weight_decay=0.0)
    lr_scheduler = get_scheduler("constant", optimizer, num_warmup_steps=0, num_training_steps=args.max_train_steps)

    dataset = TextualInversionDataset(args.train_data_dir, tokenizer, args.placeholder_token,
                                      args.resolution, args.repeats)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler, num_workers=4, drop_last=True)
    num_epochs = math.ceil(args.max_train_steps / len(loader))
    os.makedirs(args.output_dir, exist_ok=True)

    global_step = 0
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        text_encoder.train()
        for batch in loader:
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"].to(device, dtype=torch.bfloat16)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                                      device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(batch["input_ids"].to(device))[0].to(torch.bfloat16)
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")

            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            # only the placeholder row is allowed to move
            index_no_updates = torch.ones((len(tokenizer),), dtype=torch.bool, device=device)
            index_no_updates[placeholder_token_id] = False
            with torch.no_grad():
                text_encoder.module.get_input_embeddings().weight[index_no_updates] = orig_embeds[index_no_updates]

            global_step += 1
            if global_step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("step %d loss %.4f", global_step, l.item())

            if global_step % args.save_steps == 0:
                save_progress(text_encoder.module, placeholder_token_id, args.placeholder_token,
                              os.path.join(args.output_dir, f"learned_embeds-steps-{global_step}.safetensors"))

            if global_step % args.validation_steps == 0:
                if rank == 0:
                    log_validation(args, text_encoder.module, tokenizer, unet, vae, device, global_step)
                dist.barrier()

            if global_step >= args.max_train_steps:
                break

    dist.barrier()
    save_progress(text_encoder.module, placeholder_token_id, args.placeholder_token,
                  os.path.join(args.output_dir, "learned_embeds.safetensors"))
    if rank == 0:
        tokenizer.save_pretrained(args.output_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
