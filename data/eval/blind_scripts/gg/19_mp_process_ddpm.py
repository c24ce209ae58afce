#!/usr/bin/env python3
"""Unconditional DDPM (diffusers UNet2DModel) on a folder of 64x64 images.

    python 19_mp_process_ddpm.py --images /data/faces64 --num-gpus 4 --out runs/ddpm64

A launcher in this file starts one multiprocessing.Process per GPU (spawn),
sets up each worker's environment for env:// init, gives it a
log file <out>/logs/gpu<k>.log, and restarts the workers from the last
checkpoint if any of them dies.
"""
import argparse
import copy
import glob
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision.transforms as T
from diffusers import DDPMScheduler, UNet2DModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--images", default="/data/faces64")
    p.add_argument("--out", default="runs/ddpm64")
    p.add_argument("--num-gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--res", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--ema", type=float, default=0.9999)
    p.add_argument("--sample-every", type=int, default=10)
    return p.parse_args()


class ImageDir(Dataset):
    def __init__(self, root, res):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.png"), recursive=True) +
                            glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))
        self.tf = T.Compose([T.Resize(res), T.CenterCrop(res), T.RandomHorizontalFlip(),
                             T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB"))


def build_unet(res):
    return UNet2DModel(
        sample_size=res, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"))


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


@torch.no_grad()
def sample(ema, scheduler, n, res, device, steps=250):
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(steps)
    x = torch.randn(n, 3, res, res, device=device)
    for t in sched.timesteps:
        eps = ema(x, t).sample
        x = sched.step(eps, t, x).prev_sample
    return (x.clamp(-1, 1) + 1) / 2


def train(args):
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")

    data = ImageDir(args.images, args.res)
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    torch.manual_seed(0)
    model = build_unet(args.res).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * (world * args.batch / 256) ** 0.5, weight_decay=0.0)

    start = 0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        start = ck["epoch"] + 1
        print(f"resumed at epoch {start}", flush=True)
    ddp = DDP(model, device_ids=[local_rank])
    # each rank draws different noise / timesteps
    gen = torch.Generator(device=device).manual_seed(1000 + rank + 7919 * start)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for i, x0 in enumerate(loader):
            x0 = x0.to(device, non_blocking=True)
            noise = torch.randn(x0.shape, generator=gen, device=device)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (x0.size(0),), generator=gen, device=device)
            xt = noise_sched.add_noise(x0, noise, t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = ddp(xt, t).sample
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            ema_update(ema, model, args.ema)
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[1]).item():.5f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if (epoch + 1) % args.sample_every == 0:
                imgs = sample(ema, noise_sched, 64, args.res, device)
                save_image(imgs, os.path.join(args.out, f"samples_ep{epoch + 1:04d}.png"), nrow=8)
        dist.barrier()

    dist.destroy_process_group()


def entry(rank, world, args):
    log = open(os.path.join(args.out, "logs", f"gpu{rank}.log"), "a", buffering=1)
    sys.stdout = sys.stderr = log
    os.environ.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    })
    train(args)


def main():
    args = get_args()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    ctx = mp.get_context("spawn")
    world = args.num_gpus
    for attempt in range(args.restarts + 1):
        procs = [ctx.Process(target=entry, args=(r, world, args), name=f"ddpm-worker-{r}") for r in range(world)]
        for p in procs:
            p.start()
        while True:
            codes = [p.exitcode for p in procs]
            if all(c == 0 for c in codes):
                print("all workers finished", flush=True)
                return 0
            if any(c not in (None, 0) for c in codes):
                break
            time.sleep(5)
        print(f"attempt {attempt}: exit codes {codes}; stopping the rest", flush=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        time.sleep(10)
    return 1


if __name__ == "__main__":
    sys.exit(main())
