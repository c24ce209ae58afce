"""EDSR (x2/x3/x4) PSNR-oriented training on DIV2K with L1 loss.

    torchrun --nproc_per_node=4 03_edsr_psnr_baseline.py --scale 4 --pretrain experiments/edsr_x2/model_best.pt
"""
import argparse
import glob
import json
import math
import os
import random
import time

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DIV2K_MEAN = (0.4488, 0.4371, 0.4040)


def get_args():
    parser = argparse.ArgumentParser(description="EDSR training")
    parser.add_argument("--dir_data", default="/data/DIV2K")
    parser.add_argument("--data_range", default="1-800/801-900")
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--patch_size", type=int, default=192, help="HR patch size")
    parser.add_argument("--n_resblocks", type=int, default=32)
    parser.add_argument("--n_feats", type=int, default=256)
    parser.add_argument("--res_scale", type=float, default=0.1)
    parser.add_argument("--batch_size", type=int, default=16, help="total over all GPUs")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--decay", type=int, default=200, help="epochs per lr halving")
    parser.add_argument("--pretrain", default="")
    parser.add_argument("--save", default="experiments/edsr_x4")
    parser.add_argument("--n_threads", type=int, default=6)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


# ---------------------------------------------------------------------------- model
class MeanShift(nn.Conv2d):
    def __init__(self, sign=-1):
        super().__init__(3, 3, kernel_size=1)
        self.weight.data = torch.eye(3).view(3, 3, 1, 1)
        self.bias.data = sign * torch.tensor(DIV2K_MEAN)
        for p in self.parameters():
            p.requires_grad = False


class ResBlock(nn.Module):
    def __init__(self, n_feats, res_scale):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(n_feats, n_feats, 3, padding=1), nn.ReLU(True),
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x).mul(self.res_scale)


class Upsampler(nn.Sequential):
    def __init__(self, scale, n_feats):
        m = []
        if scale & (scale - 1) == 0:
            for _ in range(int(math.log2(scale))):
                m += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        elif scale == 3:
            m += [nn.Conv2d(n_feats, 9 * n_feats, 3, padding=1), nn.PixelShuffle(3)]
        else:
            raise NotImplementedError(scale)
        super().__init__(*m)


class EDSR(nn.Module):
    def __init__(self, scale, n_resblocks, n_feats, res_scale):
        super().__init__()
        self.sub_mean, self.add_mean = MeanShift(-1), MeanShift(+1)
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats, res_scale) for _ in range(n_resblocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        self.tail = nn.Sequential(Upsampler(scale, n_feats), nn.Conv2d(n_feats, 3, 3, padding=1))

    def forward(self, x):
        x = self.head(self.sub_mean(x))
        x = self.body(x) + x
        return self.add_mean(self.tail(x))


# ---------------------------------------------------------------------------- data
def augment(*imgs):
    hflip, vflip, rot90 = random.random() < 0.5, random.random() < 0.5, random.random() < 0.5

    def _aug(img):
        if hflip:
            img = img[:, ::-1]
        if vflip:
            img = img[::-1]
        if rot90:
            img = img.transpose(1, 0, 2)
        return img

    return [_aug(img) for img in imgs]


class DIV2K(Dataset):
    def __init__(self, args, begin, end, train=True):
        self.scale, self.patch, self.train = args.scale, args.patch_size, train
        hr_all = sorted(glob.glob(os.path.join(args.dir_data, "DIV2K_train_HR", "*.png")) +
                        glob.glob(os.path.join(args.dir_data, "DIV2K_valid_HR", "*.png")))
        self.hr = hr_all[begin - 1:end]
        self.lr = [p.replace("_HR", f"_LR_bicubic/X{self.scale}").replace(".png", f"x{self.scale}.png") for p in self.hr]
        self.repeat = max(1, 1000 * 16 // len(self.hr)) if train else 1  # 1000 iterations of batch 16 per epoch

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, idx):
        idx %= len(self.hr)
        lr = imageio.imread(self.lr[idx]).astype(np.float32) / 255.0
        hr = imageio.imread(self.hr[idx]).astype(np.float32) / 255.0
        s = self.scale
        if self.train:
            lp = self.patch // s
            iy, ix = random.randrange(0, lr.shape[0] - lp + 1), random.randrange(0, lr.shape[1] - lp + 1)
            lr = lr[iy:iy + lp, ix:ix + lp]
            hr = hr[iy * s:(iy + lp) * s, ix * s:(ix + lp) * s]
            lr, hr = augment(lr, hr)
        else:
            hr = hr[:lr.shape[0] * s, :lr.shape[1] * s]
        return (torch.from_numpy(np.ascontiguousarray(lr.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(hr.transpose(2, 0, 1))))


# ---------------------------------------------------------------------------- metrics
def to_y(img):
    img = (img.clamp(0, 1) * 255).round()
    return (img[:, 0] * 65.738 + img[:, 1] * 129.057 + img[:, 2] * 25.064) / 256.0 + 16.0


def psnr_ssim(sr, hr, shave):
    sr_y, hr_y = to_y(sr)[:, shave:-shave, shave:-shave], to_y(hr)[:, shave:-shave, shave:-shave]
    psnr = 10 * torch.log10(255.0 ** 2 / F.mse_loss(sr_y, hr_y))
    g = torch.exp(-((torch.arange(11, device=sr.device, dtype=torch.float64) - 5) ** 2) / (2 * 1.5 ** 2))
    win = (g[:, None] @ g[None, :] / g.sum() ** 2).view(1, 1, 11, 11)
    x, y = sr_y.unsqueeze(1).double(), hr_y.unsqueeze(1).double()
    mx, my = F.conv2d(x, win), F.conv2d(y, win)
    sxx, syy, sxy = F.conv2d(x * x, win) - mx ** 2, F.conv2d(y * y, win) - my ** 2, F.conv2d(x * y, win) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (sxx + syy + c2))
    return psnr, ssim.mean().float()


@torch.no_grad()
def evaluate(net, dataset, device, scale, rank, world):
    net.eval()
    acc = torch.zeros(3, device=device)
    for i in range(rank, len(dataset), world):
        lr, hr = dataset[i]
        sr = net(lr.unsqueeze(0).to(device))
        p, s = psnr_ssim(sr, hr.unsqueeze(0).to(device), shave=scale)
        acc += torch.stack([p, s, torch.ones_like(p)])
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    torch.manual_seed(0)
    model = EDSR(args.scale, args.n_resblocks, args.n_feats, args.res_scale).to(device)
    if args.pretrain:
        state = torch.load(args.pretrain, map_location="cpu")
        # x2 -> x4 initialisation: the upsampler shapes differ, take the body only
        own = model.state_dict()
        state = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
        model.load_state_dict(state, strict=False)
        if rank == 0:
            print(f"loaded {len(state)}/{len(own)} tensors from {args.pretrain}")
    model = DistributedDataParallel(model, device_ids=[args.local_rank])

    tr_range, te_range = args.data_range.split("/")
    train_set = DIV2K(args, *map(int, tr_range.split("-")), train=True)
    val_set = DIV2K(args, *map(int, te_range.split("-")), train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.n_threads, pin_memory=True, drop_last=True)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.decay, gamma=0.5)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
        with open(os.path.join(args.save, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_psnr = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for step, (lr, hr) in enumerate(loader):
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running += loss.item()
            if rank == 0 and (step + 1) % 100 == 0:
                print(f"[epoch {epoch} {step + 1}/{len(loader)}] L1 {running / 100:.4f} "
                      f"{time.time() - t0:.1f}s", flush=True)
                running, t0 = 0.0, time.time()
        scheduler.step()

        psnr, ssim = evaluate(model.module, val_set, device, args.scale, rank, world)
        if rank == 0:
            print(f"[epoch {epoch}] DIV2K val x{args.scale}: PSNR {psnr:.3f} SSIM {ssim:.4f}", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "psnr": psnr}
            torch.save(ckpt, os.path.join(args.save, "model_latest.pt"))
            if psnr > best_psnr:
                best_psnr = psnr
                torch.save(model.module.state_dict(), os.path.join(args.save, "model_best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
