"""RCAN x4 on RealSR (V3, Canon + Nikon), real LR/HR pairs from focal-length changes.

The validation pass writes every SR result to disk on rank 0 (for the visual review sheet)
and computes PSNR/SSIM there.

    torchrun --nproc_per_node=4 18_rcan_realsr_canon.py --root /data/RealSR_V3 --scale 4
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
from skimage.metrics import structural_similarity
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CALayer(nn.Module):
    def __init__(self, c, reduction=16):
        super().__init__()
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c // reduction, 1), nn.ReLU(True),
                                  nn.Conv2d(c // reduction, c, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.body(x)


class RCAB(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(True), nn.Conv2d(c, c, 3, padding=1),
                                  CALayer(c))

    def forward(self, x):
        return x + self.body(x)


class ResidualGroup(nn.Module):
    def __init__(self, c, n_blocks):
        super().__init__()
        self.body = nn.Sequential(*[RCAB(c) for _ in range(n_blocks)], nn.Conv2d(c, c, 3, padding=1))

    def forward(self, x):
        return x + self.body(x)


class RCAN(nn.Module):
    def __init__(self, scale=4, c=64, n_groups=5, n_blocks=10):
        super().__init__()
        self.head = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.Sequential(*[ResidualGroup(c, n_blocks) for _ in range(n_groups)],
                                  nn.Conv2d(c, c, 3, padding=1))
        ups = []
        for _ in range(scale.bit_length() - 1):
            ups += [nn.Conv2d(c, 4 * c, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*ups, nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x):
        f = self.head(x)
        return self.tail(f + self.body(f))


class RealSRPairs(Dataset):
    def __init__(self, root, split, scale, lr_patch=None):
        self.hr = sorted(glob(os.path.join(root, "*", split, str(scale), "*_HR.png")))
        self.scale, self.lr_patch = scale, lr_patch

    def __len__(self):
        return len(self.hr)

    def load(self, i):
        hr = cv2.imread(self.hr[i])[:, :, ::-1]
        lr_full = cv2.imread(self.hr[i].replace("_HR.png", f"_LR{self.scale}.png"))[:, :, ::-1]
        h, w = (hr.shape[0] // self.scale) * self.scale, (hr.shape[1] // self.scale) * self.scale
        hr, lr_full = hr[:h, :w], lr_full[:h, :w]
        # RealSR LR images are stored at HR size (registered); bring them to the true LR grid
        lr = cv2.resize(np.ascontiguousarray(lr_full), (w // self.scale, h // self.scale), interpolation=cv2.INTER_CUBIC)
        return lr, hr

    def __getitem__(self, i):
        lr, hr = self.load(i)
        if self.lr_patch:
            p, s = self.lr_patch, self.scale
            y, x = random.randint(0, lr.shape[0] - p), random.randint(0, lr.shape[1] - p)
            lr, hr = lr[y:y + p, x:x + p], hr[y * s:(y + p) * s, x * s:(x + p) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = np.rot90(lr), np.rot90(hr)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a).transpose(2, 0, 1).copy()).float() / 255.0
        return t(lr), t(hr), i


def rgb_to_y(img):
    return (16.0 + 65.481 * img[..., 0] + 128.553 * img[..., 1] + 24.966 * img[..., 2]) / 255.0


@torch.no_grad()
def validate(net, val_set, val_loader, device, rank, world, out_dir, scale):
    net.eval()
    seen, psnrs, ssims = set(), [], []
    for lr, _, idx in val_loader:
        sr = net(lr.to(device)).clamp(0, 1)
        sr_list = [torch.zeros_like(sr) for _ in range(world)]
        dist.all_gather(sr_list, sr)
        idx_t = idx.to(device)
        idx_list = [torch.zeros_like(idx_t) for _ in range(world)]
        dist.all_gather(idx_list, idx_t)
        if rank != 0:
            continue
        for sr_k, idx_k in zip(sr_list, idx_list):
            i = int(idx_k.item())
            if i in seen:  # DistributedSampler pads the last round with repeats
                continue
            seen.add(i)
            _, hr = val_set.load(i)
            sr_np = (sr_k[0].permute(1, 2, 0).cpu().numpy() * 255.0).round().astype(np.uint8)
            name = os.path.basename(val_set.hr[i]).replace("_HR.png", "_SR.png")
            cv2.imwrite(os.path.join(out_dir, name), sr_np[:, :, ::-1])
            a = rgb_to_y(sr_np.astype(np.float64) / 255.0)[scale:-scale, scale:-scale]
            b = rgb_to_y(hr.astype(np.float64) / 255.0)[scale:-scale, scale:-scale]
            psnrs.append(10 * np.log10(1.0 / np.mean((a - b) ** 2)))
            ssims.append(structural_similarity(a, b, data_range=1.0, gaussian_weights=True, sigma=1.5,
                                               use_sample_covariance=False))
    net.train()
    if rank == 0:
        return float(np.mean(psnrs)), float(np.mean(ssims))
    return None, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--lr-patch", type=int, default=48)
    ap.add_argument("--batch-per-gpu", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--val-every", type=int, default=20)
    ap.add_argument("--out", default="results/rcan_realsr_x4")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_set = RealSRPairs(args.root, "Train", args.scale, args.lr_patch)
    val_set = RealSRPairs(args.root, "Test", args.scale)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    net = RCAN(scale=args.scale).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=200, gamma=0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for lr, hr, _ in train_loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        if rank == 0:
            print(f"epoch {epoch} last-batch L1 {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        if (epoch + 1) % args.val_every == 0:
            vis_dir = os.path.join(args.out, f"epoch_{epoch + 1:04d}")
            if rank == 0:
                os.makedirs(vis_dir, exist_ok=True)
            psnr, ssim = validate(net, val_set, val_loader, device, rank, world, vis_dir, args.scale)
            if rank == 0:
                print(f"[val] epoch {epoch + 1}: PSNR-Y {psnr:.3f}  SSIM-Y {ssim:.4f}", flush=True)
                torch.save(net.state_dict(), os.path.join(args.out, "rcan_latest.pth"))
                if psnr > best:
                    best = psnr
                    torch.save(net.state_dict(), os.path.join(args.out, "rcan_best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
