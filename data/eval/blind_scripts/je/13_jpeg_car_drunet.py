"""Colour JPEG compression artifact removal with a DRUNet-style residual U-Net.

Training pairs are made on the fly: clean 128x128 crop -> JPEG at a random quality in [10, 95];
the network gets the quality as an extra input plane. Evaluated on LIVE1 at q = 10/20/30/40.

    torchrun --nproc_per_node=4 13_jpeg_car_drunet.py --train_dirs /data/DIV2K/DIV2K_train_HR /data/Flickr2K/HR
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)

    def forward(self, x):
        return x + self.conv2(F.relu(self.conv1(x), inplace=True))


class DRUNet(nn.Module):
    def __init__(self, in_nc=4, out_nc=3, nc=(64, 128, 256, 512), nb=4):
        super().__init__()
        self.head = nn.Conv2d(in_nc, nc[0], 3, 1, 1, bias=False)
        self.down = nn.ModuleList([
            nn.Sequential(*[ResBlock(nc[i]) for _ in range(nb)], nn.Conv2d(nc[i], nc[i + 1], 2, 2, bias=False))
            for i in range(3)])
        self.body = nn.Sequential(*[ResBlock(nc[3]) for _ in range(nb)])
        self.up = nn.ModuleList([
            nn.Sequential(nn.ConvTranspose2d(nc[i + 1], nc[i], 2, 2, bias=False), *[ResBlock(nc[i]) for _ in range(nb)])
            for i in reversed(range(3))])
        self.tail = nn.Conv2d(nc[0], out_nc, 3, 1, 1, bias=False)

    def forward(self, x, qf):
        h, w = x.shape[-2:]
        inp = torch.cat([x, qf.view(-1, 1, 1, 1).expand(-1, 1, h, w)], 1)
        inp = F.pad(inp, (0, (-w) % 8, 0, (-h) % 8), mode="replicate")
        x0 = self.head(inp)
        x1 = self.down[0](x0)
        x2 = self.down[1](x1)
        x3 = self.down[2](x2)
        y = self.body(x3)
        y = self.up[0](y + x3)
        y = self.up[1](y + x2)
        y = self.up[2](y + x1)
        y = self.tail(y + x0)
        return y[..., :h, :w] + x


def jpeg(img_u8, quality):
    ok, buf = cv2.imencode(".jpg", img_u8, [int(cv2.IMWRITE_JPEG_QUALITY), int(quality)])
    assert ok
    return cv2.imdecode(buf, cv2.IMREAD_COLOR)


class JPEGPairs(Dataset):
    def __init__(self, dirs, patch=128, qrange=(10, 95), copies=4):
        self.files = sorted(f for d in dirs for f in glob(os.path.join(d, "*.png")))
        self.patch, self.qrange, self.copies = patch, qrange, copies

    def __len__(self):
        return len(self.files) * self.copies

    def __getitem__(self, idx):
        img = cv2.imread(self.files[idx % len(self.files)], cv2.IMREAD_COLOR)
        h, w = img.shape[:2]
        y, x = random.randint(0, h - self.patch), random.randint(0, w - self.patch)
        img = img[y:y + self.patch, x:x + self.patch]
        img = np.ascontiguousarray(np.rot90(img, random.randint(0, 3)))
        q = random.randint(*self.qrange)
        lq = jpeg(img, q)
        to_t = lambda a: torch.from_numpy(a[..., ::-1].transpose(2, 0, 1).copy()).float() / 255.0
        return to_t(lq), to_t(img), torch.tensor(q / 100.0)


def psnr_ssim(out, gt):
    out = (out.clamp(0, 1) * 255).round().double()
    gt = (gt * 255).round().double()
    psnr = 10 * torch.log10(255.0 ** 2 / F.mse_loss(out, gt))
    g = torch.exp(-((torch.arange(11, dtype=torch.float64, device=out.device) - 5) ** 2) / 4.5)
    k = (g[:, None] * g[None] / g.sum() ** 2).expand(3, 1, 11, 11).contiguous()
    mu1, mu2 = F.conv2d(out, k, groups=3), F.conv2d(gt, k, groups=3)
    s11 = F.conv2d(out * out, k, groups=3) - mu1 ** 2
    s22 = F.conv2d(gt * gt, k, groups=3) - mu2 ** 2
    s12 = F.conv2d(out * gt, k, groups=3) - mu1 * mu2
    c1, c2 = 6.5025, 58.5225
    ssim = ((2 * mu1 * mu2 + c1) * (2 * s12 + c2)) / ((mu1 ** 2 + mu2 ** 2 + c1) * (s11 + s22 + c2))
    return psnr.item(), ssim.mean().item()


@torch.no_grad()
def eval_live1(net, files, device, qualities=(10, 20, 30, 40)):
    net.eval()
    results = {}
    for q in qualities:
        ps, ss = [], []
        for f in files:
            gt_u8 = cv2.imread(f, cv2.IMREAD_COLOR)
            lq_u8 = jpeg(gt_u8, q)
            t = lambda a: torch.from_numpy(a[..., ::-1].transpose(2, 0, 1).copy()).float().div(255).unsqueeze(0)
            out = net(t(lq_u8).to(device), torch.tensor([q / 100.0], device=device))
            p, s = psnr_ssim(out, t(gt_u8).to(device))
            ps.append(p)
            ss.append(s)
        results[q] = (float(np.mean(ps)), float(np.mean(ss)))
    net.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dirs", nargs="+", required=True)
    ap.add_argument("--live1", default="/data/LIVE1")
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="runs/jpeg_drunet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(2024)
    net = DRUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_set = JPEGPairs(args.train_dirs)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=8,
                        pin_memory=True, drop_last=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader), eta_min=1e-6)
    live1 = sorted(glob(os.path.join(args.live1, "*.bmp")))
    writer = SummaryWriter(args.out) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for lq, gt, qf in loader:
            lq, gt, qf = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True), qf.to(device)
            loss = F.l1_loss(model(lq, qf), gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/l1", loss.item(), step)
        if rank == 0:
            res = eval_live1(net, live1, device)
            for q, (p, s) in res.items():
                writer.add_scalar(f"live1/psnr_q{q}", p, epoch)
                writer.add_scalar(f"live1/ssim_q{q}", s, epoch)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): " +
                  " ".join(f"q{q}: {p:.2f}/{s:.4f}" for q, (p, s) in res.items()), flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.out, "last.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
