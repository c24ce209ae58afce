"""Style LoRA fine-tuning for Stable Diffusion 1.5 on an image/caption folder.

Plain PyTorch DDP, one process per GPU (torchrun).
The folder holds images plus a metadata.jsonl with {"file_name": ..., "text": ...} per line.
"""
import argparse
import json
import logging
import math
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from tqdm.auto import tqdm

from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger("style_lora")


def parse_args():
    p = argparse.ArgumentParser(description="SD1.5 style LoRA")
    p.add_argument("--pretrained_model", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--train_data_dir", required=True)
    p.add_argument("--output_dir", default="out/style-lora")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--train_batch_size", type=int, default=4)
    p.add_argument("--max_train_steps", type=int, default=6000)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_warmup_steps", type=int, default=200)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--caption_dropout", type=float, default=0.1,
                   help="probability of an empty caption (for classifier-free guidance)")
    p.add_argument("--mixed_precision", choices=["no", "bf16"], default="bf16")
    p.add_argument("--checkpointing_steps", type=int, default=1000)
    p.add_argument("--validation_steps", type=int, default=500)
    p.add_argument("--validation_prompt", default="a lighthouse on a cliff at dusk")
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class CaptionFolder(Dataset):
    def __init__(self, root, tokenizer, resolution, caption_dropout=0.0):
        self.root = Path(root)
        with open(self.root / "metadata.jsonl") as f:
            self.items = [json.loads(line) for line in f if line.strip()]
        self.tokenizer = tokenizer
        self.caption_dropout = caption_dropout
        self.tf = transforms.Compose([
            transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.RandomCrop(resolution),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        item = self.items[idx]
        image = Image.open(self.root / item["file_name"]).convert("RGB")
        caption = item["text"]
        if random.random() < self.caption_dropout:
            caption = ""
        ids = self.tokenizer(caption, max_length=self.tokenizer.model_max_length,
                             padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        return {"pixel_values": self.tf(image), "input_ids": ids}


def collate(examples):
    return {
        "pixel_values": torch.stack([e["pixel_values"] for e in examples]).float(),
        "input_ids": torch.stack([e["input_ids"] for e in examples]),
    }


@torch.no_grad()
def log_validation(args, unet, vae, text_encoder, tokenizer, step, device, dtype):
    pipe = StableDiffusionPipeline.from_pretrained(
        args.pretrained_model, unet=unet, vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, safety_checker=None, torch_dtype=dtype,
    ).to(device)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out_dir = Path(args.output_dir) / "samples"
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            image = pipe(args.validation_prompt, num_inference_steps=30, generator=gen).images[0]
        image.save(out_dir / f"step{step:06d}_{i}.png")
    del pipe
    torch.cuda.empty_cache()


def save_lora(unet, path):
    lora_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(save_directory=path, unet_lora_layers=lora_sd,
                                              safe_serialization=True)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32

    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(args.pretrained_model, subfolder="unet")
    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model, subfolder="scheduler")

    for m in (vae, text_encoder, unet):
        m.requires_grad_(False)
    vae.to(device, dtype=dtype)
    text_encoder.to(device, dtype=dtype)
    unet.to(device, dtype=dtype)

    unet.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    # keep the trainable LoRA weights in fp32
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    lora_params = [p for p in unet.parameters() if p.requires_grad]
    if rank == 0:
        logger.info("trainable LoRA params: %.2fM", sum(p.numel() for p in lora_params) / 1e6)

    unet = DDP(unet, device_ids=[local_rank], output_device=local_rank)

    dataset = CaptionFolder(args.train_data_dir, tokenizer, args.resolution, args.caption_dropout)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True,
                        num_workers=args.num_workers, collate_fn=collate, pin_memory=True,
                        drop_last=True, persistent_workers=args.num_workers > 0)

    optimizer = torch.optim.AdamW(lora_params, lr=args.learning_rate, betas=(0.9, 0.999),
                                  weight_decay=1e-2, eps=1e-8)
    lr_scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=args.lr_warmup_steps,
                                 num_training_steps=args.max_train_steps)
    num_epochs = math.ceil(args.max_train_steps / len(loader))

    if rank == 0:
        logger.info("examples=%d world_size=%d per-gpu batch=%d epochs=%d",
                    len(dataset), world_size, args.train_batch_size, num_epochs)

    global_step = 0
    running = torch.zeros(2, device=device)
    progress = tqdm(total=args.max_train_steps, disable=rank != 0)
    for epoch in range(num_epochs):
        unet.train()
        for batch in loader:
            pixel_values = batch["pixel_values"].to(device, dtype=dtype, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
                encoder_hidden_states = text_encoder(input_ids)[0]

            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps,
                                      (latents.shape[0],), device=device).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            if noise_scheduler.config.prediction_type == "v_prediction":
                target = noise_scheduler.get_velocity(latents, noise, timesteps)
            else:
                target = noise

            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")

            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora_params, 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            global_step += 1
            progress.update(1)
            running += torch.stack([loss.detach(), torch.ones((), device=device)])

            if global_step % 50 == 0:
                dist.all_reduce(running)
                if rank == 0:
                    avg = (running[0] / running[1]).item()
                    progress.set_postfix(loss=f"{avg:.4f}", lr=f"{lr_scheduler.get_last_lr()[0]:.2e}")
                running.zero_()

            if global_step % args.validation_steps == 0:
                if rank == 0:
                    unet.eval()
                    log_validation(args, unet.module, vae, text_encoder, tokenizer, global_step, device, dtype)
                    unet.train()
                dist.barrier()

            if global_step % args.checkpointing_steps == 0:
                if rank == 0:
                    save_lora(unet.module, os.path.join(args.output_dir, f"checkpoint-{global_step}"))
                    logger.info("saved checkpoint-%d", global_step)
                dist.barrier()

            if global_step >= args.max_train_steps:
                break
        if global_step >= args.max_train_steps:
            break

    progress.close()
    if rank == 0:
        save_lora(unet.module, args.output_dir)
        logger.info("done, LoRA written to %s", args.output_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
