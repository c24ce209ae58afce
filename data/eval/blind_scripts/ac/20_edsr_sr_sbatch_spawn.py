"""EDSR-baseline x4 super-resolution on the microscopy tiles (HR/LR pairs made on the fly).

#!/bin/bash
#SBATCH --job-name=edsr-x4
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=6
#SBATCH --time=2-00:00:00
#SBATCH --output=%x_%j.out
export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
export MASTER_PORT=12802
srun python train_edsr.py --hr-dir /scratch/proj/micro/hr --val-dir /scratch/proj/micro/val_hr \
    --out /scratch/proj/micro/runs/edsr_x4
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hr-dir", required=True)
    p.add_argument("--val-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--patch", type=int, default=48, help="LR patch size")
    p.add_argument("--bs", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="for a total batch of 16, sqrt-scaled")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--repeat", type=int, default=20, help="virtual passes over the HR set per epoch")
    return p.parse_args()


def to_tensor(img):
    return torch.from_numpy(np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0)


class PatchPairs(Dataset):
    def __init__(self, files, scale, patch, repeat):
        self.files, self.scale, self.patch, self.repeat = files, scale, patch, repeat

    def __len__(self):
        return len(self.files) * self.repeat

    def __getitem__(self, i):
        hr = Image.open(self.files[i % len(self.files)]).convert("RGB")
        hp = self.patch * self.scale
        x = random.randint(0, hr.width - hp)
        y = random.randint(0, hr.height - hp)
        hr = hr.crop((x, y, x + hp, y + hp))
        if random.random() < 0.5:
            hr = hr.transpose(Image.FLIP_LEFT_RIGHT)
        if random.random() < 0.5:
            hr = hr.transpose(Image.ROTATE_90)
        lr = hr.resize((self.patch, self.patch), Image.BICUBIC)
        return to_tensor(lr), to_tensor(hr)


class FullImages(Dataset):
    def __init__(self, files, scale):
        self.files, self.scale = files, scale

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        hr = Image.open(self.files[i]).convert("RGB")
        w, h = (hr.width // self.scale) * self.scale, (hr.height // self.scale) * self.scale
        hr = hr.crop((0, 0, w, h))
        lr = hr.resize((w // self.scale, h // self.scale), Image.BICUBIC)
        return to_tensor(lr), to_tensor(hr)


class ResBlock(nn.Module):
    def __init__(self, c, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(True), nn.Conv2d(c, c, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, scale, n_feats=64, n_blocks=16):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_blocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(n_feats, 3, 3, padding=1))

    def forward(self, x):
        x = self.head(x - self.mean)
        x = x + self.body(x)
        return self.tail(x) + self.mean


def psnr(sr, hr, shave):
    diff = (sr.clamp(0, 1) - hr)[..., shave:-shave, shave:-shave]
    return -10 * torch.log10(diff.pow(2).mean())


def train_worker(gpu, args):
    n_gpus = torch.cuda.device_count()
    node_rank = int(os.environ["SLURM_NODEID"])
    world_size = int(os.environ["SLURM_NNODES"]) * n_gpus
    rank = node_rank * n_gpus + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", gpu)
    random.seed(rank)

    hr_files = sorted(glob.glob(os.path.join(args.hr_dir, "*.png")))
    val_files = sorted(glob.glob(os.path.join(args.val_dir, "*.png")))
    train_ds = PatchPairs(hr_files, args.scale, args.patch, args.repeat)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=5, pin_memory=True,
                        drop_last=True, worker_init_fn=lambda w: random.seed(rank * 1000 + w + int(time.time())))
    val_ds = FullImages(val_files[rank::world_size], args.scale)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2)

    model = DDP(EDSR(args.scale).to(device), device_ids=[gpu])
    lr = args.lr * math.sqrt(world_size * args.bs / 16)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(args.epochs * 0.66)], gamma=0.5)

    ckpt = os.path.join(args.out, "latest.pth")
    start = 0
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        start = sd["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        l1 = torch.zeros(2, device=device)
        for lr_img, hr_img in loader:
            lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            l1 += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(l1)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            net = model.module.eval()
            s = torch.zeros(2, device=device)
            with torch.no_grad():
                for lr_img, hr_img in val_loader:
                    sr = net(lr_img.to(device))
                    s += torch.stack([psnr(sr, hr_img.to(device), args.scale), torch.ones((), device=device)])
            dist.all_reduce(s)
            if rank == 0:
                print(f"epoch {epoch} val PSNR {(s[0] / s[1]).item():.3f} dB", flush=True)

        if rank == 0:
            print(f"epoch {epoch} L1 {(l1[0] / l1[1]).item():.5f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(train_worker, args=(args,), nprocs=torch.cuda.device_count(), join=True)
