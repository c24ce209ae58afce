"""
Class-conditional latent diffusion (diffusers UNet2DModel in SD-VAE latent space) with
classifier-free guidance, EMA and Weights & Biases logging.

    torchrun --nproc_per_node=8 14_afhq_ldm_train.py --data_dir /data/afhq/train --num_classes 3 \
        --output_dir /shared/runs/afhq_ldm --wandb_project ldm-afhq
"""
import argparse
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import make_grid


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--num_classes", type=int, required=True)
    p.add_argument("--output_dir", default="runs/ldm")
    p.add_argument("--vae", default="stabilityai/sd-vae-ft-ema")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--global_batch_size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--p_uncond", type=float, default=0.1)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--ema_decay", type=float, default=0.999)
    p.add_argument("--sample_every", type=int, default=2000)
    p.add_argument("--wandb_project", default="ldm")
    p.add_argument("--run_name", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def sample_grid(ema, vae, scheduler, num_classes, guidance, device, per_class=4, steps=50):
    labels = torch.arange(num_classes, device=device).repeat_interleave(per_class)
    n = labels.shape[0]
    z = torch.randn(n, 4, ema.config.sample_size, ema.config.sample_size, device=device)
    scheduler.set_timesteps(steps, device=device)
    null = torch.full_like(labels, num_classes)
    for t in scheduler.timesteps:
        out = ema(torch.cat([z, z]), t, class_labels=torch.cat([labels, null])).sample
        cond, uncond = out.chunk(2)
        z = scheduler.step(uncond + guidance * (cond - uncond), t, z).prev_sample
    imgs = vae.decode(z / vae.config.scaling_factor).sample
    return make_grid((imgs.clamp(-1, 1) + 1) / 2, nrow=per_class)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    dist.barrier()
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args), dir=args.output_dir)

    vae = AutoencoderKL.from_pretrained(args.vae).to(device).eval().requires_grad_(False)
    latent_size = args.resolution // 8
    unet = UNet2DModel(
        sample_size=latent_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(192, 384, 576, 768),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        num_class_embeds=args.num_classes + 1,  # + null class
    ).to(device)
    ema = deepcopy(unet).eval().requires_grad_(False)
    model = DDP(unet, device_ids=[local_rank])

    train_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                beta_start=0.00085, beta_end=0.012)
    sample_sched = DDIMScheduler.from_config(train_sched.config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    tf = transforms.Compose([
        transforms.Resize(args.resolution), transforms.CenterCrop(args.resolution),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    ds = datasets.ImageFolder(args.data_dir, transform=tf)
    assert len(ds.classes) == args.num_classes, ds.classes
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.global_batch_size // world, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    total_steps = args.epochs * len(dl)
    lr_sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.02)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t_epoch = time.time()
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                z = vae.encode(x).latent_dist.sample() * vae.config.scaling_factor
            drop = torch.rand(y.shape[0], device=device) < args.p_uncond
            y = y.masked_fill(drop, args.num_classes)
            noise = torch.randn_like(z)
            t = torch.randint(0, train_sched.config.num_train_timesteps, (z.shape[0],), device=device)
            zt = train_sched.add_noise(z, noise, t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(zt, t, class_labels=y).sample
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            lr_sched.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), unet.parameters()):
                    pe.lerp_(pm, 1 - args.ema_decay)
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/grad_norm": grad_norm.item(),
                               "train/lr": lr_sched.get_last_lr()[0], "epoch": epoch}, step=step)

            if step % args.sample_every == 0:
                if rank == 0:
                    grid = sample_grid(ema, vae, sample_sched, args.num_classes, args.guidance, device)
                    wandb.log({"samples": wandb.Image(grid.permute(1, 2, 0).cpu().numpy())}, step=step)
                    torch.save({"unet": unet.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "lr_sched": lr_sched.state_dict(), "step": step},
                               os.path.join(args.output_dir, "checkpoint.pt"))
                dist.barrier()

        if rank == 0:
            wandb.log({"time/epoch_s": time.time() - t_epoch}, step=step)

    if rank == 0:
        ema.save_pretrained(os.path.join(args.output_dir, "unet_ema"))
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
