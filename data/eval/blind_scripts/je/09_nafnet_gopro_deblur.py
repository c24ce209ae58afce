"""NAFNet-width32 motion deblurring on GoPro (256x256 crops, PSNR loss, cosine schedule).

    torchrun --nproc_per_node=8 09_nafnet_gopro_deblur.py --gopro /data/GoPro
"""
import argparse
import math
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
from skimage.metrics import structural_similarity
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class LayerNorm2d(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(1, keepdim=True)
        var = (x - mu).pow(2).mean(1, keepdim=True)
        return self.weight.view(1, -1, 1, 1) * (x - mu) / (var + self.eps).sqrt() + self.bias.view(1, -1, 1, 1)


class SimpleGate(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        return a * b


class NAFBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        dw, ffn = 2 * c, 2 * c
        self.norm1, self.norm2 = LayerNorm2d(c), LayerNorm2d(c)
        self.conv1 = nn.Conv2d(c, dw, 1)
        self.conv2 = nn.Conv2d(dw, dw, 3, 1, 1, groups=dw)
        self.conv3 = nn.Conv2d(dw // 2, c, 1)
        self.sca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(dw // 2, dw // 2, 1))
        self.sg = SimpleGate()
        self.conv4 = nn.Conv2d(c, ffn, 1)
        self.conv5 = nn.Conv2d(ffn // 2, c, 1)
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, inp):
        x = self.sg(self.conv2(self.conv1(self.norm1(inp))))
        x = self.conv3(x * self.sca(x))
        y = inp + x * self.beta
        x = self.conv5(self.sg(self.conv4(self.norm2(y))))
        return y + x * self.gamma


class NAFNet(nn.Module):
    def __init__(self, width=32, enc_blks=(1, 1, 1, 28), middle_blks=1, dec_blks=(1, 1, 1, 1)):
        super().__init__()
        self.intro = nn.Conv2d(3, width, 3, 1, 1)
        self.ending = nn.Conv2d(width, 3, 3, 1, 1)
        self.encoders, self.downs, self.ups, self.decoders = (nn.ModuleList() for _ in range(4))
        c = width
        for n in enc_blks:
            self.encoders.append(nn.Sequential(*[NAFBlock(c) for _ in range(n)]))
            self.downs.append(nn.Conv2d(c, 2 * c, 2, 2))
            c *= 2
        self.middle = nn.Sequential(*[NAFBlock(c) for _ in range(middle_blks)])
        for n in dec_blks:
            self.ups.append(nn.Sequential(nn.Conv2d(c, 2 * c, 1, bias=False), nn.PixelShuffle(2)))
            c //= 2
            self.decoders.append(nn.Sequential(*[NAFBlock(c) for _ in range(n)]))
        self.pad_to = 2 ** len(enc_blks)

    def forward(self, inp):
        h, w = inp.shape[-2:]
        inp_p = F.pad(inp, (0, (-w) % self.pad_to, 0, (-h) % self.pad_to))
        x = self.intro(inp_p)
        skips = []
        for enc, down in zip(self.encoders, self.downs):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.middle(x)
        for dec, up, skip in zip(self.decoders, self.ups, reversed(skips)):
            x = dec(up(x) + skip)
        return (self.ending(x) + inp_p)[..., :h, :w]


def psnr_loss(pred, target):
    mse = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    return (10 * torch.log10(mse + 1e-8)).mean()


class GoPro(Dataset):
    def __init__(self, root, split, crop=256):
        self.blur = sorted(glob(os.path.join(root, split, "*", "blur", "*.png")))
        self.sharp = [p.replace(os.sep + "blur" + os.sep, os.sep + "sharp" + os.sep) for p in self.blur]
        self.crop, self.train = crop, split == "train"

    def __len__(self):
        return len(self.blur)

    def __getitem__(self, i):
        b = cv2.cvtColor(cv2.imread(self.blur[i]), cv2.COLOR_BGR2RGB)
        s = cv2.cvtColor(cv2.imread(self.sharp[i]), cv2.COLOR_BGR2RGB)
        if self.train:
            y, x = random.randint(0, b.shape[0] - self.crop), random.randint(0, b.shape[1] - self.crop)
            b, s = b[y:y + self.crop, x:x + self.crop], s[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                b, s = b[:, ::-1], s[:, ::-1]
            if random.random() < 0.5:
                b, s = b[::-1], s[::-1]
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return t(b), t(s)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    psnrs, ssims = [], []
    for blur, sharp in loader:
        out = model(blur.to(device)).clamp(0, 1)
        out8 = (out[0].permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
        gt8 = (sharp[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        mse = np.mean((out8.astype(np.float64) - gt8.astype(np.float64)) ** 2)
        psnrs.append(10 * math.log10(255.0 ** 2 / mse))
        ssims.append(structural_similarity(out8, gt8, channel_axis=2, data_range=255))
    model.train()
    return float(np.mean(psnrs)), float(np.mean(ssims))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gopro", default="/data/GoPro")
    ap.add_argument("--total_batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val_every", type=int, default=10000)
    ap.add_argument("--out", default="experiments/nafnet_gopro_w32")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    model = NAFNet().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.9), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.iters, eta_min=1e-7)
    it = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        it = ck["iter"]
    model = DDP(model, device_ids=[local_rank])

    train_set, test_set = GoPro(args.gopro, "train"), GoPro(args.gopro, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.total_batch // world, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    test_loader = DataLoader(test_set, batch_size=1, sampler=test_sampler, num_workers=4)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_psnr, epoch, t0 = 0.0, it // len(train_loader), time.time()
    while it < args.iters:
        train_sampler.set_epoch(epoch)
        for blur, sharp in train_loader:
            blur, sharp = blur.to(device, non_blocking=True), sharp.to(device, non_blocking=True)
            loss = psnr_loss(model(blur), sharp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                print(f"iter {it} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 200:.3f}s/it", flush=True)
                t0 = time.time()
            if it % args.val_every == 0:
                psnr, ssim = validate(model.module, test_loader, device)
                if rank == 0:
                    print(f"[val] iter {it}: GoPro PSNR {psnr:.3f} SSIM {ssim:.4f}", flush=True)
                    ck = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "iter": it}
                    torch.save(ck, os.path.join(args.out, "latest.pth"))
                    if psnr > best_psnr:
                        best_psnr = psnr
                        torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
