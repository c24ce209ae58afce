#!/usr/bin/env python
# Unconditional DDPM training (diffusers UNet2DModel) on a folder of images, e.g. CelebA-HQ 128px.
#
#   torchrun --nproc_per_node=8 07_ddpm_unet.py --train_dir data/celebahq --resolution 128
import argparse
import copy
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image

log = logging.getLogger(__name__)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_dir", required=True)
    p.add_argument("--output_dir", default="ddpm-celebahq-128")
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--train_batch_size", type=int, default=16)
    p.add_argument("--num_epochs", type=int, default=100)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_warmup_steps", type=int, default=500)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--save_images_epochs", type=int, default=10)
    p.add_argument("--save_model_epochs", type=int, default=10)
    p.add_argument("--num_train_timesteps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_unet(res):
    return UNet2DModel(
        sample_size=res, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
    )


@torch.no_grad()
def ema_update(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format=f"%(asctime)s [rank {rank}] %(message)s", level=logging.INFO)
    torch.manual_seed(args.seed + rank)

    tf = transforms.Compose([
        transforms.Resize(args.resolution, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5], [0.5]),
    ])
    dataset = datasets.ImageFolder(args.train_dir, transform=tf)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.train_batch_size, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)

    torch.manual_seed(args.seed)  # same init everywhere (DDP broadcasts anyway)
    unet = build_unet(args.resolution).to(device)
    ema_unet = copy.deepcopy(unet).eval().requires_grad_(False)
    model = DDP(unet, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank)

    noise_scheduler = DDPMScheduler(num_train_timesteps=args.num_train_timesteps)
    # lr given for a global batch of 128
    lr = args.learning_rate * args.train_batch_size * world / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-6)
    total_steps = len(loader) * args.num_epochs
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / args.lr_warmup_steps)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))))

    global_step = 0
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        for clean, _ in loader:
            clean = clean.to(device, non_blocking=True)
            noise = torch.randn_like(clean)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (clean.size(0),), device=device)
            noisy = noise_scheduler.add_noise(clean, noise, t)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(noisy, t).sample
            loss = F.mse_loss(pred.float(), noise)

            if not torch.isfinite(loss):
                log.warning("rank %d: non-finite loss at step %d, skipping batch", rank, global_step)
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_sched.step()
            ema_update(ema_unet, model.module, min(args.ema_decay, (1 + global_step) / (10 + global_step)))
            global_step += 1

            if global_step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    log.info("epoch %d step %d loss %.4f lr %.2e", epoch, global_step, l.item(),
                             lr_sched.get_last_lr()[0])

        if rank == 0:
            if (epoch + 1) % args.save_images_epochs == 0 or epoch == args.num_epochs - 1:
                pipe = DDPMPipeline(unet=ema_unet, scheduler=noise_scheduler)
                gen = torch.Generator(device=device).manual_seed(0)
                images = pipe(batch_size=16, generator=gen, output_type="np").images
                grid = torch.from_numpy(images).permute(0, 3, 1, 2)
                os.makedirs(os.path.join(args.output_dir, "samples"), exist_ok=True)
                save_image(grid, os.path.join(args.output_dir, "samples", f"epoch_{epoch:04d}.png"), nrow=4)
            if (epoch + 1) % args.save_model_epochs == 0 or epoch == args.num_epochs - 1:
                DDPMPipeline(unet=ema_unet, scheduler=noise_scheduler).save_pretrained(args.output_dir)
                torch.save({"unet": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": global_step, "epoch": epoch},
                           os.path.join(args.output_dir, "train_state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
