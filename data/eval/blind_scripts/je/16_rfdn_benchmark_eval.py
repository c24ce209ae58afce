"""RFDN (residual feature distillation network) x4, trained on DF2K and evaluated on
Set5 / Set14 / B100 / Urban100 with a per-image PSNR/SSIM table written as CSV.

    torchrun --nproc_per_node=8 16_rfdn_benchmark_eval.py --out experiments/rfdn_x4
"""
import argparse
import csv
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
from torch.utils.data.distributed import DistributedSampler

BENCHMARKS = ("Set5", "Set14", "B100", "Urban100")


def conv(cin, cout, k=3, s=1):
    return nn.Conv2d(cin, cout, k, s, k // 2)


class ESA(nn.Module):
    def __init__(self, c, f=16):
        super().__init__()
        self.conv1 = nn.Conv2d(c, f, 1)
        self.conv_f = nn.Conv2d(f, f, 1)
        self.conv_max = conv(f, f)
        self.conv2 = nn.Conv2d(f, f, 3, 2, 0)
        self.conv3 = conv(f, f)
        self.conv3_ = conv(f, f)
        self.conv4 = nn.Conv2d(f, c, 1)

    def forward(self, x):
        c1_ = self.conv1(x)
        c1 = self.conv2(c1_)
        v = F.relu(self.conv_max(F.max_pool2d(c1, kernel_size=7, stride=3)))
        c3 = self.conv3_(F.relu(self.conv3(v)))
        c3 = F.interpolate(c3, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return x * torch.sigmoid(self.conv4(c3 + self.conv_f(c1_)))


class RFDB(nn.Module):
    def __init__(self, c):
        super().__init__()
        dc = c // 2
        self.c1_d, self.c1_r = nn.Conv2d(c, dc, 1), conv(c, c)
        self.c2_d, self.c2_r = nn.Conv2d(c, dc, 1), conv(c, c)
        self.c3_d, self.c3_r = nn.Conv2d(c, dc, 1), conv(c, c)
        self.c4 = conv(c, dc)
        self.c5 = nn.Conv2d(dc * 4, c, 1)
        self.esa = ESA(c)
        self.act = nn.LeakyReLU(0.05, inplace=True)

    def forward(self, x):
        d1, r1 = self.act(self.c1_d(x)), self.act(self.c1_r(x) + x)
        d2, r2 = self.act(self.c2_d(r1)), self.act(self.c2_r(r1) + r1)
        d3, r3 = self.act(self.c3_d(r2)), self.act(self.c3_r(r2) + r2)
        r4 = self.act(self.c4(r3))
        return self.esa(self.c5(torch.cat([d1, d2, d3, r4], 1)))


class RFDN(nn.Module):
    def __init__(self, nf=50, num_modules=4, upscale=4):
        super().__init__()
        self.fea_conv = conv(3, nf)
        self.blocks = nn.ModuleList([RFDB(nf) for _ in range(num_modules)])
        self.c = nn.Sequential(nn.Conv2d(nf * num_modules, nf, 1), nn.LeakyReLU(0.05, inplace=True))
        self.lr_conv = conv(nf, nf)
        self.upsampler = nn.Sequential(conv(nf, 3 * upscale ** 2), nn.PixelShuffle(upscale))

    def forward(self, x):
        fea = self.fea_conv(x)
        feats, h = [], fea
        for blk in self.blocks:
            h = blk(h)
            feats.append(h)
        return self.upsampler(self.lr_conv(self.c(torch.cat(feats, 1))) + fea)


class TrainPairs(Dataset):
    def __init__(self, hr_dir, lr_dir, lr_patch=64):
        self.hr = sorted(glob(os.path.join(hr_dir, "*.png")))
        self.lr = sorted(glob(os.path.join(lr_dir, "*.png")))
        self.p = lr_patch

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.imread(self.hr[i])[..., ::-1]
        lr = cv2.imread(self.lr[i])[..., ::-1]
        y, x = random.randint(0, lr.shape[0] - self.p), random.randint(0, lr.shape[1] - self.p)
        lr, hr = lr[y:y + self.p, x:x + self.p], hr[4 * y:4 * (y + self.p), 4 * x:4 * (x + self.p)]
        k = random.randint(0, 3)
        lr, hr = np.rot90(lr, k), np.rot90(hr, k)
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.0
        return f(lr), f(hr)


def y_channel(img):
    img = (img.clamp(0, 1) * 255).round()
    return (65.481 * img[:, 0] + 128.553 * img[:, 1] + 24.966 * img[:, 2]) / 255.0 + 16.0


def psnr_ssim_y(sr, hr, border=4):
    a = y_channel(sr)[:, border:-border, border:-border].double()
    b = y_channel(hr)[:, border:-border, border:-border].double()
    psnr = 10 * torch.log10(255.0 ** 2 / (a - b).pow(2).mean())
    g = torch.exp(-((torch.arange(11, device=a.device, dtype=torch.float64) - 5) ** 2) / 4.5)
    w = (g[:, None] * g[None] / g.sum() ** 2).view(1, 1, 11, 11)
    a, b = a.unsqueeze(1), b.unsqueeze(1)
    ma, mb = F.conv2d(a, w), F.conv2d(b, w)
    va, vb, cab = F.conv2d(a * a, w) - ma ** 2, F.conv2d(b * b, w) - mb ** 2, F.conv2d(a * b, w) - ma * mb
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim = ((2 * ma * mb + c1) * (2 * cab + c2)) / ((ma ** 2 + mb ** 2 + c1) * (va + vb + c2))
    return psnr.float(), ssim.mean().float()


@torch.no_grad()
def benchmark(net, root, device, rank, world):
    """Every rank runs its share of each benchmark; rank 0 gets the full per-image table."""
    net.eval()
    tables = {}
    for name in BENCHMARKS:
        hr_files = sorted(glob(os.path.join(root, name, "HR", "*.png")))
        local = []
        for i in range(rank, len(hr_files), world):
            hp = hr_files[i]
            lp = os.path.join(root, name, "LR_bicubic", "X4", os.path.basename(hp).replace(".png", "x4.png"))
            lr = torch.from_numpy(cv2.imread(lp)[..., ::-1].transpose(2, 0, 1).copy()).float().div(255)
            hr = torch.from_numpy(cv2.imread(hp)[..., ::-1].transpose(2, 0, 1).copy()).float().div(255)
            hr = hr[:, :lr.shape[1] * 4, :lr.shape[2] * 4]
            sr = net(lr.unsqueeze(0).to(device))
            p, s = psnr_ssim_y(sr, hr.unsqueeze(0).to(device))
            local.append(torch.stack([torch.tensor(float(i), device=device), p, s]))
        local = torch.stack(local) if local else torch.zeros(0, 3, device=device)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        rows = torch.cat(gathered).cpu().numpy()
        rows = rows[np.argsort(rows[:, 0])]
        tables[name] = [(os.path.basename(hr_files[int(r[0])]), float(r[1]), float(r[2])) for r in rows]
    net.train()
    return tables


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hr_dir", default="/data/DF2K/HR_sub")
    ap.add_argument("--lr_dir", default="/data/DF2K/LR_bicubic_X4_sub")
    ap.add_argument("--bench_root", default="/data/benchmark")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=8, help="per GPU (8 GPUs -> 64)")
    ap.add_argument("--iters", type=int, default=1000000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--eval_every", type=int, default=20000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    net = RFDN().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=200000, gamma=0.5)
    ds = TrainPairs(args.hr_dir, args.lr_dir)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                        drop_last=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    it, epoch, t0 = 0, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lr, hr in loader:
            lr, hr = lr.to(device, non_blocking=True), hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 500 == 0:
                print(f"it {it} l1 {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
            if it % args.eval_every == 0:
                tables = benchmark(net, args.bench_root, device, rank, world)
                if rank == 0:
                    with open(os.path.join(args.out, f"bench_{it}.csv"), "w", newline="") as f:
                        w = csv.writer(f)
                        w.writerow(["set", "image", "psnr_y", "ssim_y"])
                        for name, rows in tables.items():
                            w.writerows([name, *r] for r in rows)
                            print(f"[{it}] {name}: PSNR {np.mean([r[1] for r in rows]):.3f} "
                                  f"SSIM {np.mean([r[2] for r in rows]):.4f}", flush=True)
                    torch.save({"it": it, "model": net.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict()}, os.path.join(args.out, "latest.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
