"""Night-mode enhancement: short-exposure (1/8-1/30 EV) sRGB -> long-exposure reference.

Dataset layout (captured on the tripod rig, one folder per scene):
    <root>/<scene_id>/short_*.png   several short exposures of the scene
    <root>/<scene_id>/long.png      reference

    torchrun --nproc_per_node=4 10_unet_lowlight_enhance.py --root /data/nightmode_v2 --epochs 150
"""
import argparse
import os
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--val-ratio", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8, help="per GPU")
    ap.add_argument("--crop", type=int, default=384)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=3407)
    ap.add_argument("--logdir", default="runs/nightmode_unet")
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def split_scenes(root, val_ratio):
    scenes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    random.shuffle(scenes)
    n_val = max(1, int(len(scenes) * val_ratio))
    return scenes[n_val:], scenes[:n_val]


class NightPairs(Dataset):
    def __init__(self, root, scenes, crop=None):
        self.pairs = []
        for s in scenes:
            long_path = os.path.join(root, s, "long.png")
            for short_path in sorted(glob(os.path.join(root, s, "short_*.png"))):
                self.pairs.append((short_path, long_path))
        self.crop = crop

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        sp, lp = self.pairs[i]
        lo = cv2.imread(sp, cv2.IMREAD_UNCHANGED)[..., ::-1]
        hi = cv2.imread(lp, cv2.IMREAD_UNCHANGED)[..., ::-1]
        norm = 65535.0 if lo.dtype == np.uint16 else 255.0
        lo, hi = lo.astype(np.float32) / norm, hi.astype(np.float32) / norm
        if self.crop:
            h, w = lo.shape[:2]
            y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
            lo, hi = lo[y:y + self.crop, x:x + self.crop], hi[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                lo, hi = lo[:, ::-1], hi[:, ::-1]
            if random.random() < 0.5:
                lo, hi = lo[::-1], hi[::-1]
        lo = torch.from_numpy(np.ascontiguousarray(lo.transpose(2, 0, 1)))
        hi = torch.from_numpy(np.ascontiguousarray(hi.transpose(2, 0, 1)))
        return lo, hi


class DoubleConv(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1), nn.LeakyReLU(0.2, True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.LeakyReLU(0.2, True))


class EnhanceUNet(nn.Module):
    def __init__(self, base=32, depth=4):
        super().__init__()
        chans = [base * 2 ** i for i in range(depth + 1)]
        self.inc = DoubleConv(3, chans[0])
        self.downs = nn.ModuleList(DoubleConv(chans[i], chans[i + 1]) for i in range(depth))
        self.ups = nn.ModuleList(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth)))
        self.decs = nn.ModuleList(DoubleConv(chans[i] * 2, chans[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(chans[0], 3, 1)

    def forward(self, x):
        h, w = x.shape[-2:]
        m = 2 ** len(self.downs)
        xp = F.pad(x, (0, (m - w % m) % m, 0, (m - h % m) % m), mode="reflect")
        skips = [self.inc(xp)]
        for down in self.downs:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        y = skips.pop()
        for up, dec in zip(self.ups, self.decs):
            y = dec(torch.cat([up(y), skips.pop()], 1))
        return (xp + self.out(y))[..., :h, :w]


def charbonnier(x, y, eps=1e-3):
    return torch.sqrt((x - y) ** 2 + eps ** 2).mean()


def ssim_map(x, y):
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mx, my = F.avg_pool2d(x, 11, 1, 5), F.avg_pool2d(y, 11, 1, 5)
    vx = F.avg_pool2d(x * x, 11, 1, 5) - mx ** 2
    vy = F.avg_pool2d(y * y, 11, 1, 5) - my ** 2
    cxy = F.avg_pool2d(x * y, 11, 1, 5) - mx * my
    return ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation stream on each GPU
    seed_everything(args.seed + rank)

    train_scenes, val_scenes = split_scenes(args.root, args.val_ratio)
    train_set = NightPairs(args.root, train_scenes, crop=args.crop)
    val_set = NightPairs(args.root, val_scenes)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    net = EnhanceUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    if rank == 0:
        print(f"train scenes {len(train_scenes)} ({len(train_set)} pairs), val scenes {len(val_scenes)}")

    best_psnr = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (lo, hi) in enumerate(loader):
            lo, hi = lo.to(device, non_blocking=True), hi.to(device, non_blocking=True)
            out = model(lo)
            loss = charbonnier(out, hi) + 0.2 * (1 - ssim_map(out, hi).mean())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if writer is not None and i % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(loader) + i)
        sched.step()

        # validation: every rank takes every world-th pair of the held-out scenes
        net.eval()
        stats = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for j in range(rank, len(val_set), world):
                lo, hi = val_set[j]
                out = net(lo[None].to(device)).clamp(0, 1)
                hi = hi[None].to(device)
                mse = F.mse_loss(out.double(), hi.double())
                stats[0] += 10 * torch.log10(1 / mse)
                stats[1] += ssim_map(out.double(), hi.double()).mean()
                stats[2] += 1
        dist.all_reduce(stats)
        psnr, ssim = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()

        if rank == 0:
            writer.add_scalar("val/psnr", psnr, epoch)
            writer.add_scalar("val/ssim", ssim, epoch)
            print(f"epoch {epoch:03d} val PSNR {psnr:.2f} SSIM {ssim:.4f}", flush=True)
            os.makedirs(os.path.join(args.logdir, "ckpt"), exist_ok=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.logdir, "ckpt", "last.pth"))
            if psnr > best_psnr:
                best_psnr = psnr
                torch.save(net.state_dict(), os.path.join(args.logdir, "ckpt", "best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
