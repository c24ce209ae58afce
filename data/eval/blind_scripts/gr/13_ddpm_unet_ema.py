"""
Unconditional DDPM on a folder of 64x64 images (diffusers UNet2DModel + DDPMScheduler),
with EMA weights and periodic sample grids.

DDP launch:
    torchrun --nproc_per_node=8 13_ddpm_unet_ema.py --data /data/celeba64 --out runs/ddpm64
"""
import argparse
import copy
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.utils import save_image
from tqdm import tqdm

log = logging.getLogger("ddpm")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/ddpm")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--ema-decay", type=float, default=0.9999)
    ap.add_argument("--timesteps", type=int, default=1000)
    ap.add_argument("--sample-every", type=int, default=5000)
    ap.add_argument("--save-every", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def cleanup():
    dist.destroy_process_group()


def is_main_process():
    return dist.get_rank() == 0


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ImageDir(Dataset):
    EXTS = (".jpg", ".jpeg", ".png", ".webp")

    def __init__(self, root, size):
        self.files = sorted(
            os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.lower().endswith(self.EXTS)
        )
        self.tf = transforms.Compose([
            transforms.Resize(size),
            transforms.CenterCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB"))


def build_unet(size):
    return UNet2DModel(
        sample_size=size,
        in_channels=3,
        out_channels=3,
        layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
    )


@torch.no_grad()
def update_ema(ema_model, model, decay):
    for ema_p, p in zip(ema_model.parameters(), model.parameters()):
        ema_p.mul_(decay).add_(p.detach(), alpha=1 - decay)


@torch.no_grad()
def sample_grid(ema_model, scheduler, n, size, device, path):
    ema_model.eval()
    gen = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(n, 3, size, size, device=device, generator=gen)
    scheduler.set_timesteps(250)
    for t in scheduler.timesteps:
        eps = ema_model(x, t).sample
        x = scheduler.step(eps, t, x, generator=gen).prev_sample
    save_image((x.clamp(-1, 1) + 1) / 2, path, nrow=int(n ** 0.5))


def main():
    args = parse_args()
    local_rank = setup()
    device = torch.device("cuda", local_rank)
    world_size = dist.get_world_size()
    seed_everything(args.seed + dist.get_rank())
    logging.basicConfig(level=logging.INFO if is_main_process() else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    dataset = ImageDir(args.data, args.image_size)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = build_unet(args.image_size).to(device)
    model = DDP(model, device_ids=[local_rank])
    # EMA copy taken after DDP has broadcast rank 0's initial weights
    ema_model = copy.deepcopy(model.module).requires_grad_(False)

    noise_scheduler = DDPMScheduler(num_train_timesteps=args.timesteps, beta_schedule="linear")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5000))

    if is_main_process():
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        log.info("%d images, %d GPUs, global batch %d", len(dataset), world_size, args.batch_size * world_size)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        pbar = tqdm(loader, disable=not is_main_process(), desc=f"epoch {epoch}")
        for clean in pbar:
            clean = clean.to(device, non_blocking=True)
            noise = torch.randn_like(clean)
            t = torch.randint(0, args.timesteps, (clean.size(0),), device=device)
            noisy = noise_scheduler.add_noise(clean, noise, t)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(noisy, t).sample
            loss = F.mse_loss(pred.float(), noise)

            if not torch.isfinite(loss):
                log.warning("non-finite loss at step %d, skipping batch", global_step)
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            warmup.step()
            update_ema(ema_model, model.module, args.ema_decay)
            global_step += 1

            if is_main_process():
                pbar.set_postfix(loss=f"{loss.item():.4f}", step=global_step)
                if global_step % args.sample_every == 0:
                    sample_grid(ema_model, DDPMScheduler.from_config(noise_scheduler.config), 64,
                                args.image_size, device,
                                os.path.join(args.out, "samples", f"step_{global_step:07d}.png"))
                if global_step % args.save_every == 0:
                    torch.save({"model": model.module.state_dict(), "ema": ema_model.state_dict(),
                                "optimizer": optimizer.state_dict(), "step": global_step},
                               os.path.join(args.out, "checkpoint.pt"))

    if is_main_process():
        ema_model.save_pretrained(os.path.join(args.out, "ema_unet"))
    dist.barrier()
    cleanup()


if __name__ == "__main__":
    main()
