"""
DDIM-style training (eps-prediction, cosine schedule) on CelebA-HQ 256, multi-GPU DDP,
with automatic resume from <exp>/last.pt.

    torchrun --nproc_per_node=8 08_ddim_celebahq.py --config configs/celebahq256.yaml
"""
import argparse
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from diffusers import UNet2DModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms, utils

DEFAULTS = dict(
    data_root="/datasets/celebahq256",
    exp_dir="/checkpoints/ddim_celebahq",
    image_size=256,
    batch_size=64,          # global
    lr=2e-5,
    warmup=5000,
    epochs=500,
    ema_rate=0.9999,
    num_timesteps=1000,
    grad_clip=1.0,
    num_workers=6,
    log_interval=50,
    sample_interval=5000,
    seed=0,
)


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def cosine_schedule(T, s=0.008):
    x = torch.linspace(0, T, T + 1, dtype=torch.float64)
    ac = torch.cos(((x / T) + s) / (1 + s) * math.pi * 0.5) ** 2
    ac = ac / ac[0]
    betas = 1 - (ac[1:] / ac[:-1])
    return betas.clamp(0, 0.999).float()


@torch.no_grad()
def ddim_sample(model, abar, n, size, device, steps=100):
    x = torch.randn(n, 3, size, size, device=device)
    seq = list(range(0, len(abar), len(abar) // steps))
    for i, j in zip(reversed(seq), reversed([-1] + seq[:-1])):
        t = torch.full((n,), i, device=device, dtype=torch.long)
        at = abar[i]
        at_next = abar[j] if j >= 0 else torch.tensor(1.0, device=device)
        e = model(x, t).sample
        x0 = ((x - (1 - at).sqrt() * e) / at.sqrt()).clamp(-1, 1)
        x = at_next.sqrt() * x0 + (1 - at_next).sqrt() * e
    return x


def save_checkpoint(path, model, ema, opt, epoch, step):
    state = {
        "model": model.module.state_dict(),
        "ema": ema.state_dict(),
        "opt": opt.state_dict(),
        "epoch": epoch,
        "step": step,
    }
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = load_config(ap.parse_args().config)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(os.path.join(cfg.exp_dir, "samples"), exist_ok=True)
        tb = SummaryWriter(os.path.join(cfg.exp_dir, "tb"))
    dist.barrier()

    tf = transforms.Compose([
        transforms.Resize(cfg.image_size),
        transforms.CenterCrop(cfg.image_size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    dataset = datasets.ImageFolder(cfg.data_root, transform=tf)
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size // world, sampler=sampler,
                        num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    unet = UNet2DModel(
        sample_size=cfg.image_size, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4,
    ).to(device)
    ema = deepcopy(unet).eval().requires_grad_(False)
    opt = torch.optim.AdamW(unet.parameters(), lr=cfg.lr, weight_decay=0.0)

    start_epoch, step = 0, 0
    last = os.path.join(cfg.exp_dir, "last.pt")
    if os.path.exists(last):
        ckpt = torch.load(last, map_location="cpu")
        unet.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
        if rank == 0:
            print(f"resumed from {last} at epoch {start_epoch}, step {step}")
    model = DDP(unet, device_ids=[local_rank])

    betas = cosine_schedule(cfg.num_timesteps).to(device)
    abar = torch.cumprod(1 - betas, 0)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for x, _ in loader:
            x = x.to(device, non_blocking=True)
            t = torch.randint(0, cfg.num_timesteps, (x.size(0),), device=device)
            e = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x * a.sqrt() + e * (1 - a).sqrt(), t).sample
            loss = (e - out.float()).square().mean()

            for g in opt.param_groups:
                g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), unet.parameters()):
                    pe.mul_(cfg.ema_rate).add_(p, alpha=1 - cfg.ema_rate)
            step += 1

            if step % cfg.log_interval == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tb.add_scalar("loss", l.item(), step)
                    tb.add_scalar("lr", opt.param_groups[0]["lr"], step)

            if step % cfg.sample_interval == 0 and rank == 0:
                imgs = ddim_sample(ema, abar, 16, cfg.image_size, device, steps=50)
                utils.save_image(imgs * 0.5 + 0.5, os.path.join(cfg.exp_dir, "samples", f"{step:07d}.png"), nrow=4)

        save_checkpoint(last, model, ema, opt, epoch, step)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - tic:.0f}s (step {step})", flush=True)
        dist.barrier()

    if rank == 0:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
