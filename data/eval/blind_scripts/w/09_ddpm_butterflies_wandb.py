"""
Unconditional DDPM on the Smithsonian butterflies dataset (diffusers UNet2DModel).
Based on the HF "train a diffusion model" tutorial, rewritten with torchrun/DDP.

    torchrun --nproc_per_node=4 09_ddpm_butterflies_wandb.py --image_size 128 --epochs 50
"""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from diffusers.utils import make_image_grid
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from tqdm.auto import tqdm


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="huggan/smithsonian_butterflies_subset")
    p.add_argument("--image_size", type=int, default=128)
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--save_image_epochs", type=int, default=10)
    p.add_argument("--save_model_epochs", type=int, default=25)
    p.add_argument("--output_dir", default="ddpm-butterflies-128")
    p.add_argument("--project", default="ddpm-butterflies")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_unet(image_size):
    return UNet2DModel(
        sample_size=image_size,
        in_channels=3,
        out_channels=3,
        layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
    )


def get_dataset(name, image_size):
    dataset = load_dataset(name, split="train")
    preprocess = transforms.Compose([
        transforms.Resize((image_size, image_size)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])

    def transform(examples):
        images = [preprocess(img.convert("RGB")) for img in examples["image"]]
        return {"images": images}

    dataset.set_transform(transform)
    return dataset


def save_samples(unet, scheduler, epoch, out_dir, seed):
    pipeline = DDPMPipeline(unet=unet, scheduler=scheduler)
    images = pipeline(batch_size=16, generator=torch.Generator(device="cpu").manual_seed(seed)).images
    grid = make_image_grid(images, rows=4, cols=4)
    os.makedirs(os.path.join(out_dir, "samples"), exist_ok=True)
    path = os.path.join(out_dir, "samples", f"{epoch:04d}.png")
    grid.save(path)
    return grid


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    wandb.init(project=args.project, config=vars(args), name=f"ddpm-{args.image_size}")

    # let rank 0 download / prepare the HF cache before the other ranks touch it
    if rank != 0:
        dist.barrier()
    dataset = get_dataset(args.dataset, args.image_size)
    if rank == 0:
        dist.barrier()
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True)

    unet = build_unet(args.image_size).to(device)
    model = DDP(unet, device_ids=[local_rank])
    noise_scheduler = DDPMScheduler(num_train_timesteps=1000)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    lr_scheduler = get_cosine_schedule_with_warmup(
        optimizer, num_warmup_steps=args.lr_warmup_steps, num_training_steps=len(loader) * args.epochs
    )

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(dataset)} images, {len(loader)} steps/epoch/GPU, {world_size} GPUs")

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        progress = tqdm(total=len(loader), disable=rank != 0, desc=f"Epoch {epoch}")
        epoch_loss = torch.zeros(1, device=device)

        for batch in loader:
            clean = batch["images"].to(device, non_blocking=True)
            noise = torch.randn_like(clean)
            bs = clean.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bs,), device=device).long()
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                noise_pred = model(noisy, timesteps, return_dict=False)[0]
            loss = F.mse_loss(noise_pred.float(), noise)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()

            epoch_loss += loss.detach()
            global_step += 1
            progress.update(1)
            progress.set_postfix(loss=loss.item(), lr=lr_scheduler.get_last_lr()[0])
            wandb.log({"loss": loss.item(), "lr": lr_scheduler.get_last_lr()[0]}, step=global_step)
        progress.close()

        dist.all_reduce(epoch_loss)
        mean_loss = epoch_loss.item() / (len(loader) * world_size)
        wandb.log({"epoch_loss": mean_loss, "epoch": epoch}, step=global_step)

        if rank == 0:
            print(f"epoch {epoch}: mean loss {mean_loss:.5f}")
            last = epoch == args.epochs - 1
            if (epoch + 1) % args.save_image_epochs == 0 or last:
                model.eval()
                grid = save_samples(model.module, noise_scheduler, epoch, args.output_dir, args.seed)
                wandb.log({"samples": wandb.Image(grid)}, step=global_step)
            if (epoch + 1) % args.save_model_epochs == 0 or last:
                DDPMPipeline(unet=model.module, scheduler=noise_scheduler).save_pretrained(args.output_dir)
                print(f"saved pipeline to {args.output_dir}")
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
