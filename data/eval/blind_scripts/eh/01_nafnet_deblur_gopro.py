"""NAFNet-width32 motion deblurring on GoPro (paired blur / sharp crops).

Launch:
    torchrun --nproc_per_node=8 01_nafnet_deblur_gopro.py --data-root /mnt/datasets/GoPro
"""
import argparse
import glob
import logging
import math
import os
import random
import time

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

logger = logging.getLogger("nafnet")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/mnt/datasets/GoPro")
    p.add_argument("--out-dir", default="experiments/nafnet_gopro_w32")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--total-iters", type=int, default=200_000)
    p.add_argument("--val-every", type=int, default=10_000)
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=10)
    p.add_argument("--resume", default="")
    return p.parse_args()


# ----------------------------------------------------------------------------- model
class LayerNorm2d(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(1, keepdim=True)
        var = (x - mu).pow(2).mean(1, keepdim=True)
        x = (x - mu) / torch.sqrt(var + self.eps)
        return self.weight.view(1, -1, 1, 1) * x + self.bias.view(1, -1, 1, 1)


class SimpleGate(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        return a * b


class NAFBlock(nn.Module):
    def __init__(self, c, dw_expand=2, ffn_expand=2):
        super().__init__()
        dw = c * dw_expand
        self.conv1 = nn.Conv2d(c, dw, 1)
        self.conv2 = nn.Conv2d(dw, dw, 3, padding=1, groups=dw)
        self.conv3 = nn.Conv2d(dw // 2, c, 1)
        self.sca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(dw // 2, dw // 2, 1))
        self.sg = SimpleGate()
        ffn = c * ffn_expand
        self.conv4 = nn.Conv2d(c, ffn, 1)
        self.conv5 = nn.Conv2d(ffn // 2, c, 1)
        self.norm1 = LayerNorm2d(c)
        self.norm2 = LayerNorm2d(c)
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, inp):
        x = self.conv2(self.conv1(self.norm1(inp)))
        x = self.sg(x)
        x = self.conv3(x * self.sca(x))
        y = inp + x * self.beta
        x = self.conv5(self.sg(self.conv4(self.norm2(y))))
        return y + x * self.gamma


class NAFNet(nn.Module):
    def __init__(self, width=32, middle_blk_num=1, enc_blk_nums=(1, 1, 1, 28), dec_blk_nums=(1, 1, 1, 1)):
        super().__init__()
        self.intro = nn.Conv2d(3, width, 3, padding=1)
        self.ending = nn.Conv2d(width, 3, 3, padding=1)
        self.encoders, self.downs = nn.ModuleList(), nn.ModuleList()
        self.decoders, self.ups = nn.ModuleList(), nn.ModuleList()
        chan = width
        for n in enc_blk_nums:
            self.encoders.append(nn.Sequential(*[NAFBlock(chan) for _ in range(n)]))
            self.downs.append(nn.Conv2d(chan, chan * 2, 2, 2))
            chan *= 2
        self.middle = nn.Sequential(*[NAFBlock(chan) for _ in range(middle_blk_num)])
        for n in dec_blk_nums:
            self.ups.append(nn.Sequential(nn.Conv2d(chan, chan * 2, 1, bias=False), nn.PixelShuffle(2)))
            chan //= 2
            self.decoders.append(nn.Sequential(*[NAFBlock(chan) for _ in range(n)]))
        self.padder = 2 ** len(enc_blk_nums)

    def forward(self, inp):
        _, _, h, w = inp.shape
        ph = (self.padder - h % self.padder) % self.padder
        pw = (self.padder - w % self.padder) % self.padder
        inp = F.pad(inp, (0, pw, 0, ph))
        x = self.intro(inp)
        skips = []
        for enc, down in zip(self.encoders, self.downs):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.middle(x)
        for dec, up, skip in zip(self.decoders, self.ups, skips[::-1]):
            x = dec(up(x) + skip)
        x = self.ending(x) + inp
        return x[:, :, :h, :w]


class PSNRLoss(nn.Module):
    def forward(self, pred, target):
        mse = ((pred - target) ** 2).mean(dim=(1, 2, 3))
        return 10.0 * torch.log10(mse + 1e-8).mean()


# ----------------------------------------------------------------------------- data
class GoProPairs(Dataset):
    def __init__(self, root, split, patch_size=None):
        self.blur = sorted(glob.glob(os.path.join(root, split, "*", "blur", "*.png")))
        self.sharp = [p.replace(f"{os.sep}blur{os.sep}", f"{os.sep}sharp{os.sep}") for p in self.blur]
        self.patch_size = patch_size

    def __len__(self):
        return len(self.blur)

    @staticmethod
    def _read(path):
        img = cv2.imread(path, cv2.IMREAD_COLOR)
        return img[:, :, ::-1].astype(np.float32) / 255.0

    def __getitem__(self, idx):
        lq, gt = self._read(self.blur[idx]), self._read(self.sharp[idx])
        if self.patch_size:
            h, w = gt.shape[:2]
            top = random.randint(0, h - self.patch_size)
            left = random.randint(0, w - self.patch_size)
            lq = lq[top:top + self.patch_size, left:left + self.patch_size]
            gt = gt[top:top + self.patch_size, left:left + self.patch_size]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
            if random.random() < 0.5:
                lq, gt = lq[::-1], gt[::-1]
        lq = torch.from_numpy(np.ascontiguousarray(lq.transpose(2, 0, 1)))
        gt = torch.from_numpy(np.ascontiguousarray(gt.transpose(2, 0, 1)))
        return lq, gt


# ----------------------------------------------------------------------------- metrics
def calc_psnr(a, b):
    mse = torch.mean((a.double() - b.double()) ** 2)
    return float("inf") if mse == 0 else (10 * torch.log10(1.0 / mse)).item()


def calc_ssim(a, b):
    a, b = a.double(), b.double()
    c = a.shape[1]
    coords = torch.arange(11, dtype=torch.float64, device=a.device) - 5
    g = torch.exp(-(coords ** 2) / (2 * 1.5 ** 2))
    g = g / g.sum()
    win = (g[:, None] @ g[None, :]).expand(c, 1, 11, 11).contiguous()
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    mu_a, mu_b = F.conv2d(a, win, groups=c), F.conv2d(b, win, groups=c)
    s_aa = F.conv2d(a * a, win, groups=c) - mu_a ** 2
    s_bb = F.conv2d(b * b, win, groups=c) - mu_b ** 2
    s_ab = F.conv2d(a * b, win, groups=c) - mu_a * mu_b
    m = ((2 * mu_a * mu_b + c1) * (2 * s_ab + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (s_aa + s_bb + c2))
    return m.mean().item()


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    psnr_sum, ssim_sum, count = 0.0, 0.0, 0
    for lq, gt in loader:
        lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
        out = net(lq).clamp(0, 1)
        out = torch.round(out * 255) / 255
        psnr_sum += calc_psnr(out, gt)
        ssim_sum += calc_ssim(out, gt)
        count += 1
    net.train()
    return psnr_sum, ssim_sum, count


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if is_main:
        os.makedirs(os.path.join(args.out_dir, "models"), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out_dir, "tb"))

    assert args.global_batch % world_size == 0
    batch_per_gpu = args.global_batch // world_size
    train_set = GoProPairs(args.data_root, "train", args.patch_size)
    val_set = GoProPairs(args.data_root, "test")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=batch_per_gpu, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # full-resolution test set is large, split it across ranks
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2, pin_memory=True)

    net = NAFNet(width=args.width).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.9), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.total_iters, eta_min=1e-7)
    criterion = PSNRLoss()

    start_iter, best_psnr = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.load_state_dict(ckpt["params"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_iter, best_psnr = ckpt["iter"], ckpt["best_psnr"]

    it = start_iter
    epoch = start_iter // len(train_loader)
    t0 = time.time()
    while it < args.total_iters:
        train_sampler.set_epoch(epoch)
        for lq, gt in train_loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            out = model(lq)
            loss = criterion(out, gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            optimizer.step()
            scheduler.step()
            it += 1

            if is_main and it % 100 == 0:
                elapsed = (time.time() - t0) / 100
                logger.info("iter %d/%d loss %.4f lr %.2e %.3fs/it", it, args.total_iters,
                            loss.item(), scheduler.get_last_lr()[0], elapsed)
                writer.add_scalar("train/psnr_loss", loss.item(), it)
                t0 = time.time()

            if it % args.val_every == 0 or it == args.total_iters:
                psnr_sum, ssim_sum, count = validate(net, val_loader, device)
                if is_main:
                    avg_psnr, avg_ssim = psnr_sum / count, ssim_sum / count
                    logger.info("[val] iter %d PSNR %.3f SSIM %.4f", it, avg_psnr, avg_ssim)
                    writer.add_scalar("val/psnr", avg_psnr, it)
                    writer.add_scalar("val/ssim", avg_ssim, it)
                    state = {"params": net.state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict(), "iter": it,
                             "best_psnr": max(best_psnr, avg_psnr)}
                    torch.save(state, os.path.join(args.out_dir, "models", "latest.pth"))
                    if avg_psnr > best_psnr:
                        best_psnr = avg_psnr
                        torch.save(state, os.path.join(args.out_dir, "models", "best.pth"))
                dist.barrier()
            if it >= args.total_iters:
                break
        epoch += 1

    if is_main:
        logger.info("done, best PSNR %.3f", best_psnr)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
