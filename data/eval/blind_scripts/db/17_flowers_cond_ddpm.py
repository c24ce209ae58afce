#!/usr/bin/env python
# Class-conditional DDPM (diffusers UNet2DModel, pixel space 128x128) on Oxford Flowers-102,
# with a held-out split for validation loss tracking.
#
#   torchrun --nproc_per_node=4 17_flowers_cond_ddpm.py --root /data/flowers102/jpg_by_class --out runs/flowers
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, random_split
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="runs/flowers")
    p.add_argument("--res", type=int, default=128)
    p.add_argument("--val_frac", type=float, default=0.05)
    p.add_argument("--global_bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--p_uncond", type=float, default=0.15)
    p.add_argument("--ema_decay", type=float, default=0.9995)
    p.add_argument("--val_every", type=int, default=5)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--amp", action="store_true")
    return p.parse_args()


class Transformed(torch.utils.data.Dataset):
    def __init__(self, subset, tf):
        self.subset, self.tf = subset, tf

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, y = self.subset[i]
        return self.tf(img), y


@torch.no_grad()
def validation_loss(unet, loader, sched, device, n_t=10):
    """Average eps-MSE over a fixed grid of timesteps, reduced over all ranks."""
    unet.eval()
    ts = torch.linspace(0, sched.config.num_train_timesteps - 1, n_t, device=device).long()
    total = torch.zeros(2, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        for t in ts:
            noise = torch.randn(x.shape, device=device, generator=g)
            xt = sched.add_noise(x, noise, t.repeat(x.shape[0]))
            pred = unet(xt, t.repeat(x.shape[0]), class_labels=y).sample
            total[0] += F.mse_loss(pred, noise, reduction="sum") / x[0].numel()
            total[1] += x.shape[0]
    dist.all_reduce(total)
    unet.train()
    return (total[0] / total[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed + rank)  # different noise/timesteps per GPU

    full = datasets.ImageFolder(args.root)
    num_classes = len(full.classes)
    n_val = int(len(full) * args.val_frac)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.res, scale=(0.7, 1.0), ratio=(0.9, 1.1)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    val_tf = transforms.Compose([
        transforms.Resize(args.res), transforms.CenterCrop(args.res),
        transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    train_ds, val_ds = Transformed(train_sub, train_tf), Transformed(val_sub, val_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.global_bs // world, sampler=train_sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    # strided shard without padding, so the summed loss / count is exact after all_reduce
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.global_bs // world, num_workers=2)

    unet = UNet2DModel(
        sample_size=args.res, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 128, 256, 384, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
        num_class_embeds=num_classes + 1,
    ).to(device)
    ema = EMAModel(unet.parameters(), decay=args.ema_decay, model_cls=UNet2DModel, model_config=unet.config)
    ema.to(device)
    model = DDP(unet, device_ids=[local_rank])
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(args.out)
        print(f"{len(train_ds)} train / {len(val_ds)} val images, {num_classes} classes", flush=True)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y = torch.where(torch.rand(y.shape, device=device) < args.p_uncond, torch.full_like(y, num_classes), y)
            noise = torch.randn_like(x)
            t = torch.randint(0, sched.config.num_train_timesteps, (x.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                pred = model(sched.add_noise(x, noise, t), t, class_labels=y).sample
                loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            ema.step(unet.parameters())
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer:
                    writer.add_scalar("train/loss", l.item(), step)

        if (epoch + 1) % args.val_every == 0:
            ema.store(unet.parameters())
            ema.copy_to(unet.parameters())
            vloss = validation_loss(unet, val_dl, sched, device)
            ema.restore(unet.parameters())
            if rank == 0:
                writer.add_scalar("val/ema_loss", vloss, step)
                print(f"epoch {epoch + 1}: val loss (EMA) {vloss:.4f}, {time.time() - t0:.0f}s/epoch", flush=True)
                unet.save_pretrained(os.path.join(args.out, "unet"))
                ema.save_pretrained(os.path.join(args.out, "unet_ema"))
            dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
