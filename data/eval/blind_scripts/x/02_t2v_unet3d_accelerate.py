#!/usr/bin/env python
# Text-to-video fine-tuning of a UNet3D (ModelScope-style) on WebVid-like clips.
#
#   accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
#       train_t2v.py --config configs/webvid_256.yaml
#
import argparse
import logging
import math
import os
import shutil

import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import AutoencoderKL, DDPMScheduler, UNet3DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from einops import rearrange
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import CLIPTextModel, CLIPTokenizer

import webdataset as wds

logger = get_logger(__name__, log_level="INFO")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=str, required=True)
    p.add_argument("--resume_from_checkpoint", type=str, default=None)
    args = p.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg["resume_from_checkpoint"] = args.resume_from_checkpoint
    return argparse.Namespace(**cfg)


def make_video_pipeline(urls, tokenizer, num_frames, size, frame_stride, shuffle_buf=1000):
    import torchvision.transforms.v2 as T

    tf = T.Compose([T.Resize(size, antialias=True), T.CenterCrop(size)])

    def decode(sample):
        frames = sample["frames.pth"]  # uint8 [F, C, H, W], decoded by the shard writer
        frames = frames[::frame_stride][:num_frames]
        frames = tf(frames).float() / 127.5 - 1.0
        ids = tokenizer(sample["txt"], max_length=tokenizer.model_max_length, padding="max_length",
                        truncation=True, return_tensors="pt").input_ids[0]
        return {"pixel_values": frames, "input_ids": ids}

    # resampled=True: every rank/worker draws shards on its own (infinite stream), and with_epoch()
    # below fixes the number of batches per rank, so all ranks run the same number of steps
    return (
        wds.WebDataset(urls, resampled=True, shardshuffle=True)
        .shuffle(shuffle_buf)
        .decode(wds.torch_video, handler=wds.warn_and_continue)
        .map(decode, handler=wds.warn_and_continue)
        .select(lambda s: s["pixel_values"].shape[0] == num_frames)
    )


def main():
    args = parse_args()
    project_config = ProjectConfiguration(project_dir=args.output_dir, total_limit=args.checkpoints_total_limit)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with="wandb",
        project_config=project_config,
    )
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed, device_specific=True)

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)

    noise_scheduler = DDPMScheduler.from_pretrained(args.pretrained_model, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.pretrained_model, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(args.pretrained_model, subfolder="vae")
    unet = UNet3DConditionModel.from_pretrained(args.pretrained_model, subfolder="unet")

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.enable_gradient_checkpointing()

    ema_unet = EMAModel(unet.parameters(), decay=args.ema_decay, model_cls=UNet3DConditionModel,
                        model_config=unet.config)

    weight_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
    vae.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)

    # save/load hooks so that save_state writes diffusers-format folders and the EMA
    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
            for m in models:
                m.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()

    def load_model_hook(models, input_dir):
        load_ema = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet3DConditionModel)
        ema_unet.load_state_dict(load_ema.state_dict())
        ema_unet.to(accelerator.device)
        del load_ema
        for _ in range(len(models)):
            m = models.pop()
            loaded = UNet3DConditionModel.from_pretrained(input_dir, subfolder="unet")
            m.register_to_config(**loaded.config)
            m.load_state_dict(loaded.state_dict())
            del loaded

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    # learning rate given for a reference global batch of 64; scale linearly
    global_bs = args.train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    lr = args.learning_rate * global_bs / 64 if args.scale_lr else args.learning_rate
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)

    dataset = make_video_pipeline(args.train_shards, tokenizer, args.num_frames, args.resolution, args.frame_stride)
    train_dataloader = wds.WebLoader(dataset, batch_size=args.train_batch_size, num_workers=args.num_workers,
                                     pin_memory=True).with_epoch(args.steps_per_epoch * args.gradient_accumulation_steps)

    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)

    # the webdataset loader is already split per node/worker, so only the model and optimizer are prepared
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    ema_unet.to(accelerator.device)

    if accelerator.is_main_process:
        accelerator.init_trackers("t2v-unet3d", config=vars(args))

    global_step = 0
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint
        if path == "latest":
            dirs = sorted([d for d in os.listdir(args.output_dir) if d.startswith("checkpoint")],
                          key=lambda d: int(d.split("-")[1]))
            path = os.path.join(args.output_dir, dirs[-1]) if dirs else None
        if path is not None:
            accelerator.print(f"Resuming from {path}")
            accelerator.load_state(path)
            global_step = int(os.path.basename(path).split("-")[1])

    progress_bar = tqdm(range(global_step, args.max_train_steps), disable=not accelerator.is_local_main_process)
    unet.train()
    train_loss = 0.0
    while global_step < args.max_train_steps:
        for batch in train_dataloader:
            with accelerator.accumulate(unet):
                pixels = batch["pixel_values"].to(accelerator.device, dtype=weight_dtype)
                b, f = pixels.shape[:2]
                with torch.no_grad():
                    latents = vae.encode(rearrange(pixels, "b f c h w -> (b f) c h w")).latent_dist.sample()
                    latents = rearrange(latents, "(b f) c h w -> b c f h w", b=b) * vae.config.scaling_factor
                    text_emb = text_encoder(batch["input_ids"].to(accelerator.device))[0]

                # per-sample caption dropout for classifier-free guidance; every sample still goes through
                # the same modules, only the embedding values change
                if args.caption_dropout > 0:
                    null_emb = text_encoder(tokenizer([""] * b, max_length=tokenizer.model_max_length,
                                                      padding="max_length", return_tensors="pt"
                                                      ).input_ids.to(accelerator.device))[0]
                    keep = (torch.rand(b, device=accelerator.device) >= args.caption_dropout).view(b, 1, 1)
                    text_emb = torch.where(keep, text_emb, null_emb)

                noise = torch.randn_like(latents)
                if args.noise_offset:
                    noise += args.noise_offset * torch.randn(b, latents.shape[1], 1, 1, 1, device=latents.device)
                timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,), device=latents.device)
                noisy = noise_scheduler.add_noise(latents, noise, timesteps)
                target = noise if noise_scheduler.config.prediction_type == "epsilon" else \
                    noise_scheduler.get_velocity(latents, noise, timesteps)

                model_pred = unet(noisy, timesteps, encoder_hidden_states=text_emb).sample
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")

                avg_loss = accelerator.gather(loss.detach().repeat(b)).mean()
                train_loss += avg_loss.item() / args.gradient_accumulation_steps

                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            if accelerator.sync_gradients:
                ema_unet.step(unet.parameters())
                progress_bar.update(1)
                global_step += 1
                accelerator.log({"train_loss": train_loss, "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)
                train_loss = 0.0

                if global_step % args.checkpointing_steps == 0:
                    # every process enters save_state; the hooks and accelerate decide who writes
                    save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                    accelerator.save_state(save_path)
                    logger.info(f"Saved state to {save_path}")

                if accelerator.is_main_process and global_step % args.validation_steps == 0:
                    log_validation(accelerator.unwrap_model(unet), ema_unet, vae, text_encoder, tokenizer,
                                   noise_scheduler, args, accelerator, global_step, weight_dtype)

            progress_bar.set_postfix(loss=loss.detach().item(), lr=lr_scheduler.get_last_lr()[0])
            if global_step >= args.max_train_steps:
                break

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        unet = accelerator.unwrap_model(unet)
        ema_unet.copy_to(unet.parameters())
        unet.save_pretrained(os.path.join(args.output_dir, "unet_final_ema"))
    accelerator.end_training()


@torch.no_grad()
def log_validation(unet, ema_unet, vae, text_encoder, tokenizer, scheduler, args, accelerator, step, dtype):
    from diffusers import TextToVideoSDPipeline
    import numpy as np
    import wandb

    ema_unet.store(unet.parameters())
    ema_unet.copy_to(unet.parameters())
    unet.eval()
    pipe = TextToVideoSDPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                 scheduler=scheduler).to(accelerator.device)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator(device=accelerator.device).manual_seed(args.seed)
    videos = []
    for prompt in args.validation_prompts:
        with torch.autocast("cuda", dtype=dtype):
            frames = pipe(prompt, num_frames=args.num_frames, height=args.resolution, width=args.resolution,
                          num_inference_steps=25, guidance_scale=args.guidance_scale, generator=gen,
                          output_type="np").frames[0]
        videos.append(wandb.Video((np.transpose(frames, (0, 3, 1, 2)) * 255).astype(np.uint8), fps=8,
                                  caption=prompt))
    accelerator.get_tracker("wandb").log({"validation": videos}, step=step)
    ema_unet.restore(unet.parameters())
    unet.train()
    del pipe
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
