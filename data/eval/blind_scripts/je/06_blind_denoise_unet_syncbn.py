"""Blind Gaussian colour denoising (sigma in [0, 50]) with a BN U-Net, EMA weights for evaluation.

    torchrun --nnodes=1 --nproc_per_node=4 06_blind_denoise_unet_syncbn.py \
        --train_dirs /data/DIV2K/DIV2K_train_HR /data/WED /data/BSD400 --val_dir /data/CBSD68
"""
import argparse
import math
import os
import random
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def conv_bn_relu(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class DenoiseUNet(nn.Module):
    def __init__(self, ch=(64, 128, 256, 512)):
        super().__init__()
        self.inc = nn.Sequential(conv_bn_relu(4, ch[0]), conv_bn_relu(ch[0], ch[0]))  # RGB + noise-level map
        self.downs = nn.ModuleList()
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for a, b in zip(ch[:-1], ch[1:]):
            self.downs.append(nn.Sequential(nn.Conv2d(a, b, 2, 2, bias=False), conv_bn_relu(b, b), conv_bn_relu(b, b)))
        for a, b in zip(reversed(ch[1:]), reversed(ch[:-1])):
            self.ups.append(nn.ConvTranspose2d(a, b, 2, 2, bias=False))
            self.up_convs.append(nn.Sequential(conv_bn_relu(2 * b, b), conv_bn_relu(b, b)))
        self.out = nn.Conv2d(ch[0], 3, 3, 1, 1)

    def forward(self, noisy, sigma_map):
        h, w = noisy.shape[-2:]
        ph, pw = (-h) % 8, (-w) % 8
        x = F.pad(torch.cat([noisy, sigma_map], 1), (0, pw, 0, ph), mode="replicate")
        skips = [self.inc(x)]
        for d in self.downs:
            skips.append(d(skips[-1]))
        y = skips.pop()
        for up, conv in zip(self.ups, self.up_convs):
            y = conv(torch.cat([up(y), skips.pop()], 1))
        return noisy - self.out(y)[..., :h, :w]


class CleanPatches(Dataset):
    def __init__(self, dirs, patch=128, patches_per_image=8):
        self.files = sorted(f for d in dirs for f in glob(os.path.join(d, "*.*")))
        self.patch, self.ppi = patch, patches_per_image

    def __len__(self):
        return len(self.files) * self.ppi

    def __getitem__(self, idx):
        img = np.asarray(Image.open(self.files[idx // self.ppi]).convert("RGB"), dtype=np.float32) / 255.0
        h, w = img.shape[:2]
        if min(h, w) < self.patch:
            s = self.patch / min(h, w)
            img = np.asarray(Image.fromarray((img * 255).astype(np.uint8)).resize((math.ceil(w * s), math.ceil(h * s)),
                                                                                   Image.BICUBIC), np.float32) / 255.0
            h, w = img.shape[:2]
        y, x = random.randint(0, h - self.patch), random.randint(0, w - self.patch)
        img = np.rot90(img[y:y + self.patch, x:x + self.patch], random.randint(0, 3))
        if random.random() < 0.5:
            img = img[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))


def psnr_ssim_rgb(x, y):
    x = (x.clamp(0, 1) * 255).round()
    y = y * 255
    psnr = 10 * torch.log10(255.0 ** 2 / F.mse_loss(x, y))
    k = torch.exp(-((torch.arange(11, device=x.device, dtype=torch.float64) - 5) ** 2) / 4.5)
    k = (k[:, None] * k[None, :] / k.sum() ** 2).expand(3, 1, 11, 11)
    xd, yd = x.double(), y.double()
    mx, my = F.conv2d(xd, k, groups=3), F.conv2d(yd, k, groups=3)
    vx, vy = F.conv2d(xd * xd, k, groups=3) - mx ** 2, F.conv2d(yd * yd, k, groups=3) - my ** 2
    cxy = F.conv2d(xd * yd, k, groups=3) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return psnr, ssim.mean().float()


@torch.no_grad()
def evaluate(net, files, sigma, device, rank, world):
    """Each rank denoises every world-th image; noise is seeded by image index so results do not depend on world size."""
    net.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for idx in range(rank, len(files), world):
        clean = torch.from_numpy(np.asarray(Image.open(files[idx]).convert("RGB"), np.float32) / 255.0)
        clean = clean.permute(2, 0, 1).unsqueeze(0).to(device)
        g = torch.Generator(device=device).manual_seed(idx)
        noisy = clean + torch.randn(clean.shape, generator=g, device=device) * (sigma / 255.0)
        out = net(noisy, torch.full_like(clean[:, :1], sigma / 255.0))
        p, s = psnr_ssim_rgb(out, clean)
        sums += torch.stack([p.double(), s.double(), torch.ones((), device=device, dtype=torch.float64)])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dirs", nargs="+", required=True)
    ap.add_argument("--val_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max_sigma", type=float, default=50.0)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--out", default="runs/denoise_unet")
    ap.add_argument("--resume", default="")
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(args.seed)  # same initial weights everywhere
    net = DenoiseUNet()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)

    train_set = CleanPatches(args.train_dirs)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    steps_per_epoch = len(loader) // args.accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch,
                                                pct_start=0.05)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        net.load_state_dict(ckpt["net"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    model = DDP(net, device_ids=[local_rank])
    noise_gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)  # different noise per rank
    writer = SummaryWriter(args.out) if rank == 0 else None
    val_files = sorted(glob(os.path.join(args.val_dir, "*.png")))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, clean in enumerate(loader):
            if i >= steps_per_epoch * args.accum:
                break
            clean = clean.to(device, non_blocking=True)
            sigma = torch.rand(clean.size(0), 1, 1, 1, device=device, generator=noise_gen) * args.max_sigma / 255.0
            noisy = clean + torch.randn(clean.shape, device=device, generator=noise_gen) * sigma
            sync_now = (i + 1) % args.accum == 0
            if sync_now:
                loss = F.l1_loss(model(noisy, sigma.expand_as(clean[:, :1])), clean) / args.accum
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                ema.update_parameters(net)
            else:
                with model.no_sync():
                    loss = F.l1_loss(model(noisy, sigma.expand_as(clean[:, :1])), clean) / args.accum
                    loss.backward()
            if writer is not None and sync_now and (i // args.accum) % 50 == 0:
                step = epoch * steps_per_epoch + i // args.accum
                writer.add_scalar("train/l1", loss.item() * args.accum, step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        psnr, ssim = evaluate(ema.module, val_files, 25.0, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch}: CBSD68 sigma=25 EMA PSNR {psnr:.3f} SSIM {ssim:.4f}", flush=True)
            writer.add_scalar("val/psnr_s25", psnr, epoch)
            writer.add_scalar("val/ssim_s25", ssim, epoch)
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
