"""IMDN lightweight SR (x4) with long schedules, so runs are preempted and resumed a lot.

    torchrun --nproc_per_node=4 12_imdn_lightweight_resume.py --out experiments/imdn_x4
    torchrun --nproc_per_node=4 12_imdn_lightweight_resume.py --out experiments/imdn_x4 \
        --resume experiments/imdn_x4/last.pth
"""
import argparse
import logging
import os
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("imdn")


def conv(cin, cout, k=3):
    return nn.Conv2d(cin, cout, k, 1, k // 2)


class CCALayer(nn.Module):
    """Contrast-aware channel attention (std + mean pooling)."""

    def __init__(self, c, reduction=16):
        super().__init__()
        self.fc = nn.Sequential(nn.Conv2d(c, c // reduction, 1), nn.ReLU(inplace=True),
                                nn.Conv2d(c // reduction, c, 1), nn.Sigmoid())

    def forward(self, x):
        mean = x.mean(dim=(2, 3), keepdim=True)
        std = (x - mean).pow(2).mean(dim=(2, 3), keepdim=True).sqrt()
        return x * self.fc(mean + std)


class IMDModule(nn.Module):
    def __init__(self, c=64, distill_rate=0.25):
        super().__init__()
        self.dc = int(c * distill_rate)
        self.rc = c - self.dc
        self.c1, self.c2, self.c3 = conv(c, c), conv(self.rc, c), conv(self.rc, c)
        self.c4 = conv(self.rc, self.dc)
        self.act = nn.LeakyReLU(0.05, inplace=True)
        self.c5 = conv(self.dc * 4, c, 1)
        self.cca = CCALayer(self.dc * 4)

    def forward(self, x):
        d1, r1 = torch.split(self.act(self.c1(x)), (self.dc, self.rc), 1)
        d2, r2 = torch.split(self.act(self.c2(r1)), (self.dc, self.rc), 1)
        d3, r3 = torch.split(self.act(self.c3(r2)), (self.dc, self.rc), 1)
        d4 = self.c4(r3)
        return self.c5(self.cca(torch.cat([d1, d2, d3, d4], 1))) + x


class IMDN(nn.Module):
    def __init__(self, nf=64, num_modules=6, upscale=4):
        super().__init__()
        self.fea_conv = conv(3, nf)
        self.blocks = nn.ModuleList([IMDModule(nf) for _ in range(num_modules)])
        self.c = nn.Sequential(conv(nf * num_modules, nf, 1), nn.LeakyReLU(0.05, inplace=True))
        self.lr_conv = conv(nf, nf)
        self.upsampler = nn.Sequential(conv(nf, 3 * upscale ** 2), nn.PixelShuffle(upscale))

    def forward(self, x):
        fea = self.fea_conv(x)
        outs, h = [], fea
        for b in self.blocks:
            h = b(h)
            outs.append(h)
        out = self.lr_conv(self.c(torch.cat(outs, 1))) + fea
        return self.upsampler(out)


class SRPairs(Dataset):
    def __init__(self, hr_glob, scale=4, lr_patch=64, train=True):
        self.hr = sorted(glob(hr_glob))
        self.lr = [p.replace("HR", f"LR_bicubic/X{scale}").replace(".png", f"x{scale}.png") for p in self.hr]
        self.scale, self.p, self.train = scale, lr_patch, train

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.imread(self.hr[i], cv2.IMREAD_COLOR)[..., ::-1]
        lr = cv2.imread(self.lr[i], cv2.IMREAD_COLOR)[..., ::-1]
        s = self.scale
        if self.train:
            y, x = random.randint(0, lr.shape[0] - self.p), random.randint(0, lr.shape[1] - self.p)
            lr, hr = lr[y:y + self.p, x:x + self.p], hr[y * s:(y + self.p) * s, x * s:(x + self.p) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr[::-1], hr[::-1]
        else:
            hr = hr[:lr.shape[0] * s, :lr.shape[1] * s]
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return f(lr), f(hr)


def psnr_y(sr, hr, border=4):
    k = sr.new_tensor([65.481, 128.553, 24.966]).view(1, 3, 1, 1)
    a = ((sr.clamp(0, 1) * 255).round() / 255 * k).sum(1)[..., border:-border, border:-border]
    b = (hr * k).sum(1)[..., border:-border, border:-border]
    return 10 * torch.log10(255.0 ** 2 / (a - b).pow(2).mean(dim=(-2, -1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_glob", default="/data/DF2K/HR/*.png")
    ap.add_argument("--val_glob", default="/data/DIV2K/DIV2K_valid_HR/*.png")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--val_every", type=int, default=20, help="epochs")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    torch.manual_seed(0)
    net = IMDN().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[200, 400, 600, 800], gamma=0.5)
    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best_psnr"]
        log.info("resumed at epoch %d (best %.3f)", start_epoch, best)
    model = DDP(net, device_ids=[local_rank])

    train_set = SRPairs(args.train_glob, train=True)
    val_set = SRPairs(args.val_glob, train=False)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=1, num_workers=2)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0, total = time.time(), 0.0
        for lr, hr in loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item()
        scheduler.step()
        log.info("epoch %d: L1 %.4f  lr %.2e  %.1fs", epoch, total / len(loader), scheduler.get_last_lr()[0],
                 time.time() - t0)

        if (epoch + 1) % args.val_every == 0:
            net.eval()
            acc = torch.zeros(2, device=device)
            with torch.no_grad():
                for lr, hr in val_loader:
                    acc[0] += psnr_y(net(lr.to(device)), hr.to(device)).sum()
                    acc[1] += lr.size(0)
            dist.all_reduce(acc)
            net.train()
            psnr = (acc[0] / acc[1]).item()
            best = max(best, psnr)
            log.info("epoch %d: DIV2K-val PSNR-Y %.3f (best %.3f)", epoch, psnr, best)
            if rank == 0 and psnr >= best:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_psnr": best},
                       os.path.join(args.out, "last.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
