#!/usr/bin/env python
# Class-conditional DDPM (diffusers UNet2DModel) on 64x64 crops of our product-photo set.
#
#   torchrun --standalone --nproc_per_node=4 17_ddpm_unet_train.py \
#       --data /data/products64 --out runs/ddpm64 --epochs 200
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/ddpm")
    p.add_argument("--res", type=int, default=64)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.9999)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--sample_every", type=int, default=10)
    p.add_argument("--cond_drop", type=float, default=0.1)
    return p.parse_args()


def build_data(args):
    tf = transforms.Compose([
        transforms.Resize(args.res),
        transforms.CenterCrop(args.res),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True)
    return ds, sampler, dl


def build_unet(res, n_classes):
    return UNet2DModel(
        sample_size=res,
        in_channels=3,
        out_channels=3,
        layers_per_block=2,
        block_out_channels=(128, 256, 256, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
        num_class_embeds=n_classes + 1,  # last id = unconditional
    )


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm, 1 - decay)
    for be, bm in zip(ema.buffers(), model.buffers()):
        be.copy_(bm)


@torch.no_grad()
def sample(ema, sched, n_classes, device, res, n=16, guidance=3.0, steps=250):
    sched = copy.deepcopy(sched)
    sched.set_timesteps(steps)
    x = torch.randn(n, 3, res, res, device=device)
    y = torch.arange(n, device=device) % n_classes
    y_null = torch.full_like(y, n_classes)
    for t in sched.timesteps:
        tt = t.expand(n).to(device)
        eps_c = ema(x, tt, class_labels=y).sample
        eps_u = ema(x, tt, class_labels=y_null).sample
        eps = eps_u + guidance * (eps_c - eps_u)
        x = sched.step(eps, t, x).prev_sample
    return (x.clamp(-1, 1) + 1) / 2


def main():
    args = get_args()
    ds, sampler, dl = build_data(args)
    n_classes = len(ds.classes)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)

    unet = build_unet(args.res, n_classes).to(device)
    model = DDP(unet, device_ids=[local_rank])
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} images, {n_classes} classes, {dist.get_world_size()} GPUs", flush=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            drop = torch.rand(y.shape, device=device) < args.cond_drop
            y = torch.where(drop, torch.full_like(y, n_classes), y)
            noise = torch.randn_like(x)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (x.size(0),), device=device)
            xt = noise_sched.add_noise(x, noise, t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(xt, t, class_labels=y).sample
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ema_update(ema, unet, args.ema)
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f}", flush=True)

        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s", flush=True)
            torch.save({"unet": unet.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(args.out, "last.pt"))
            if (epoch + 1) % args.sample_every == 0:
                imgs = sample(ema, noise_sched, n_classes, device, args.res)
                save_image(imgs, os.path.join(args.out, f"samples_ep{epoch:04d}.png"), nrow=4)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
