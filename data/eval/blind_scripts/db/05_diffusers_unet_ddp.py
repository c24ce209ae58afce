#!/usr/bin/env python
"""Unconditional DDPM (diffusers UNet2DModel) on a HF image dataset, plain DDP training loop.

    torchrun --nproc_per_node=4 05_diffusers_unet_ddp.py \
        --dataset_name huggan/smithsonian_butterflies_subset --output_dir ddpm-butterflies-128
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm.auto import tqdm


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset_name", type=str, default="huggan/smithsonian_butterflies_subset")
    parser.add_argument("--cache_dir", type=str, default=None)
    parser.add_argument("--output_dir", type=str, default="ddpm-model-64")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--train_batch_size", type=int, default=16)
    parser.add_argument("--eval_batch_size", type=int, default=16)
    parser.add_argument("--num_epochs", type=int, default=100)
    parser.add_argument("--save_images_epochs", type=int, default=10)
    parser.add_argument("--save_model_epochs", type=int, default=10)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--lr_scheduler", type=str, default="cosine")
    parser.add_argument("--lr_warmup_steps", type=int, default=500)
    parser.add_argument("--adam_weight_decay", type=float, default=1e-6)
    parser.add_argument("--ema_max_decay", type=float, default=0.9999)
    parser.add_argument("--ddpm_num_steps", type=int, default=1000)
    parser.add_argument("--ddpm_num_inference_steps", type=int, default=250)
    parser.add_argument("--mixed_precision", type=str, default="fp16", choices=["no", "fp16", "bf16"])
    parser.add_argument("--dataloader_num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def build_unet(resolution):
    return UNet2DModel(
        sample_size=resolution,
        in_channels=3,
        out_channels=3,
        layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
    )


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    is_main = rank == 0

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)

    # download/prepare on rank 0 first so the others read the arrow cache
    if not is_main:
        dist.barrier()
    dataset = load_dataset(args.dataset_name, cache_dir=args.cache_dir, split="train")
    if is_main:
        dist.barrier()

    augmentations = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])

    def transform_images(examples):
        return {"input": [augmentations(image.convert("RGB")) for image in examples["image"]]}

    dataset.set_transform(transform_images)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_dataloader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler,
                                  num_workers=args.dataloader_num_workers, drop_last=True)

    unet = build_unet(args.resolution).to(device)
    ema_model = EMAModel(unet.parameters(), decay=args.ema_max_decay, use_ema_warmup=True,
                         inv_gamma=1.0, power=3 / 4, model_cls=UNet2DModel, model_config=unet.config)
    ema_model.to(device)
    model = DDP(unet, device_ids=[local_rank], output_device=local_rank)

    noise_scheduler = DDPMScheduler(num_train_timesteps=args.ddpm_num_steps, beta_schedule="linear")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.95, 0.999),
                                  weight_decay=args.adam_weight_decay, eps=1e-8)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps, num_training_steps=max_train_steps)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "no": torch.float32}[args.mixed_precision]
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision == "fp16")

    global_step = 0
    for epoch in range(args.num_epochs):
        model.train()
        sampler.set_epoch(epoch)
        progress_bar = tqdm(total=num_update_steps_per_epoch, disable=not is_main, desc=f"Epoch {epoch}")
        for step, batch in enumerate(train_dataloader):
            clean_images = batch["input"].to(device, non_blocking=True)
            noise = torch.randn_like(clean_images)
            bsz = clean_images.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,), device=device).long()
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)

            sync = (step + 1) % args.gradient_accumulation_steps == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype, enabled=args.mixed_precision != "no"):
                    model_output = model(noisy_images, timesteps).sample
                loss = F.mse_loss(model_output.float(), noise.float()) / args.gradient_accumulation_steps
                scaler.scale(loss).backward()

            if sync:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                ema_model.step(unet.parameters())
                global_step += 1
                progress_bar.update(1)
                logged = loss.detach() * args.gradient_accumulation_steps
                dist.all_reduce(logged, op=dist.ReduceOp.AVG)
                progress_bar.set_postfix(loss=logged.item(), lr=lr_scheduler.get_last_lr()[0],
                                         ema_decay=ema_model.cur_decay_value, step=global_step)
        progress_bar.close()

        if is_main:
            last_epoch = epoch == args.num_epochs - 1
            if (epoch + 1) % args.save_images_epochs == 0 or last_epoch:
                ema_model.store(unet.parameters())
                ema_model.copy_to(unet.parameters())
                pipeline = DDPMPipeline(unet=unet, scheduler=noise_scheduler)
                generator = torch.Generator(device="cpu").manual_seed(0)
                images = pipeline(generator=generator, batch_size=args.eval_batch_size,
                                  num_inference_steps=args.ddpm_num_inference_steps, output_type="pil").images
                ema_model.restore(unet.parameters())
                os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
                for i, img in enumerate(images):
                    img.save(os.path.join(args.output_dir, "samples", f"e{epoch:04d}_{i:02d}.png"))

            if (epoch + 1) % args.save_model_epochs == 0 or last_epoch:
                model.save_pretrained(os.path.join(args.output_dir, "unet"))
                ema_model.save_pretrained(os.path.join(args.output_dir, "unet_ema"))
                torch.save({"optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
                            "epoch": epoch, "global_step": global_step},
                           os.path.join(args.output_dir, "training_state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
