#!/usr/bin/env python3
"""IFRNet-style frame interpolation on Vimeo-90K triplets.

Launch with torchrun, e.g.
    torchrun --nproc_per_node=4 01_ifrnet_vimeo_triplet.py --data /data/vimeo_triplet
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("ifrnet")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/ifrnet")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=24, help="global batch size")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr_min", type=float, default=1e-5)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


# ----------------------------------------------------------------------------- data
class VimeoTriplet(Dataset):
    def __init__(self, root, train=True, crop=224):
        list_file = "tri_trainlist.txt" if train else "tri_testlist.txt"
        with open(os.path.join(root, list_file)) as f:
            self.items = [line.strip() for line in f if line.strip()]
        self.seq_dir = os.path.join(root, "sequences")
        self.train = train
        self.crop = crop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        d = os.path.join(self.seq_dir, self.items[idx])
        frames = [cv2.imread(os.path.join(d, f"im{k}.png"))[:, :, ::-1] for k in (1, 2, 3)]
        if self.train:
            h, w, _ = frames[0].shape
            y = random.randint(0, h - self.crop)
            x = random.randint(0, w - self.crop)
            frames = [f[y:y + self.crop, x:x + self.crop] for f in frames]
            if random.random() < 0.5:
                frames = [f[:, ::-1] for f in frames]
            if random.random() < 0.5:
                frames = [f[::-1] for f in frames]
            if random.random() < 0.5:
                frames = frames[::-1]
        frames = [torch.from_numpy(np.ascontiguousarray(f)).permute(2, 0, 1).float() / 255.0 for f in frames]
        return frames[0], frames[1], frames[2]


# ----------------------------------------------------------------------------- model
def convrelu(cin, cout, k=3, s=1, p=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, p), nn.PReLU(cout))


def resize(x, scale):
    return F.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False)


def backwarp(img, flow):
    b, _, h, w = flow.shape
    gy, gx = torch.meshgrid(torch.linspace(-1.0, 1.0, h, device=flow.device),
                            torch.linspace(-1.0, 1.0, w, device=flow.device), indexing="ij")
    grid = torch.stack((gx, gy), 0).unsqueeze(0)
    flow = torch.cat([flow[:, 0:1] / ((w - 1.0) / 2.0), flow[:, 1:2] / ((h - 1.0) / 2.0)], 1)
    g = (grid + flow).permute(0, 2, 3, 1)
    return F.grid_sample(img, g, mode="bilinear", padding_mode="border", align_corners=True)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = convrelu(c, c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1)
        self.act = nn.PReLU(c)

    def forward(self, x):
        return self.act(x + self.conv2(self.conv1(x)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.p1 = nn.Sequential(convrelu(3, 32, 3, 2, 1), convrelu(32, 32))
        self.p2 = nn.Sequential(convrelu(32, 48, 3, 2, 1), convrelu(48, 48))
        self.p3 = nn.Sequential(convrelu(48, 72, 3, 2, 1), convrelu(72, 72))
        self.p4 = nn.Sequential(convrelu(72, 96, 3, 2, 1), convrelu(96, 96))

    def forward(self, x):
        f1 = self.p1(x)
        f2 = self.p2(f1)
        f3 = self.p3(f2)
        f4 = self.p4(f3)
        return f1, f2, f3, f4


class Decoder(nn.Module):
    def __init__(self, cin, cmid, cout):
        super().__init__()
        self.block = nn.Sequential(convrelu(cin, cmid), ResBlock(cmid), nn.ConvTranspose2d(cmid, cout, 4, 2, 1))

    def forward(self, *xs):
        return self.block(torch.cat(xs, 1))


class IFRNetLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder4 = Decoder(96 * 2 + 1, 192, 4 + 72)
        self.decoder3 = Decoder(72 * 3 + 4, 144, 4 + 48)
        self.decoder2 = Decoder(48 * 3 + 4, 96, 4 + 32)
        self.decoder1 = Decoder(32 * 3 + 4, 64, 4 + 1 + 3)

    def forward(self, img0, img1, embt):
        mean_ = torch.cat([img0, img1], 2).mean((1, 2, 3), keepdim=True)
        img0, img1 = img0 - mean_, img1 - mean_
        f0_1, f0_2, f0_3, f0_4 = self.encoder(img0)
        f1_1, f1_2, f1_3, f1_4 = self.encoder(img1)

        out4 = self.decoder4(f0_4, f1_4, embt.expand(-1, 1, *f0_4.shape[2:]))
        flow0, flow1, ft = out4[:, 0:2], out4[:, 2:4], out4[:, 4:]
        out3 = self.decoder3(ft, backwarp(f0_3, flow0), backwarp(f1_3, flow1), flow0, flow1)
        flow0 = out3[:, 0:2] + 2.0 * resize(flow0, 2.0)
        flow1 = out3[:, 2:4] + 2.0 * resize(flow1, 2.0)
        out2 = self.decoder2(out3[:, 4:], backwarp(f0_2, flow0), backwarp(f1_2, flow1), flow0, flow1)
        flow0 = out2[:, 0:2] + 2.0 * resize(flow0, 2.0)
        flow1 = out2[:, 2:4] + 2.0 * resize(flow1, 2.0)
        out1 = self.decoder1(out2[:, 4:], backwarp(f0_1, flow0), backwarp(f1_1, flow1), flow0, flow1)
        flow0 = out1[:, 0:2] + 2.0 * resize(flow0, 2.0)
        flow1 = out1[:, 2:4] + 2.0 * resize(flow1, 2.0)
        mask = torch.sigmoid(out1[:, 4:5])
        res = out1[:, 5:8]
        merged = mask * backwarp(img0, flow0) + (1 - mask) * backwarp(img1, flow1) + mean_
        return torch.clamp(merged + res, 0, 1)


def charbonnier(pred, gt, eps=1e-6):
    return torch.sqrt((pred - gt) ** 2 + eps).mean()


# ----------------------------------------------------------------------------- train / eval
@torch.no_grad()
def evaluate(net, dataset, device, rank, world):
    net.eval()
    shard = Subset(dataset, list(range(rank, len(dataset), world)))
    loader = DataLoader(shard, batch_size=1, num_workers=2)
    stats = torch.zeros(2, device=device)  # psnr sum, count
    for img0, gt, img1 in loader:
        img0, gt, img1 = img0.to(device), gt.to(device), img1.to(device)
        embt = torch.full((img0.shape[0], 1, 1, 1), 0.5, device=device)
        pred = net(img0, img1, embt)
        mse = ((pred - gt) ** 2).mean((1, 2, 3))
        stats[0] += (-10.0 * torch.log10(mse)).sum()
        stats[1] += mse.numel()
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = VimeoTriplet(args.data, train=True, crop=args.crop)
    test_set = VimeoTriplet(args.data, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    per_gpu = args.batch_size // world
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)

    model = IFRNetLite().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    start_epoch, best_psnr = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_psnr = ckpt["epoch"] + 1, ckpt.get("best_psnr", 0.0)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("world=%d per-gpu batch=%d steps/epoch=%d", world, per_gpu, len(train_loader))

    total_steps = args.epochs * len(train_loader)
    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for img0, gt, img1 in train_loader:
            lr = args.lr_min + 0.5 * (args.lr - args.lr_min) * (1 + math.cos(math.pi * step / total_steps))
            for g in optimizer.param_groups:
                g["lr"] = lr
            img0 = img0.to(device, non_blocking=True)
            gt = gt.to(device, non_blocking=True)
            img1 = img1.to(device, non_blocking=True)
            embt = torch.full((img0.shape[0], 1, 1, 1), 0.5, device=device)

            pred = model(img0, img1, embt)
            loss = charbonnier(pred, gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", lr, step)
        if rank == 0:
            logger.info("epoch %d done in %.1fs, last loss %.4f", epoch, time.time() - t0, loss.item())

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            psnr = evaluate(model.module, test_set, device, rank, world)
            if rank == 0:
                writer.add_scalar("val/psnr", psnr, epoch)
                logger.info("epoch %d  Vimeo90K test PSNR %.3f", epoch, psnr)
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch, "best_psnr": max(best_psnr, psnr)}
                torch.save(state, os.path.join(args.out, "latest.pth"))
                if psnr > best_psnr:
                    best_psnr = psnr
                    torch.save(state, os.path.join(args.out, "best.pth"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
