"""IMDN (information multi-distillation network) for efficient x4 SR.

Validation runs on the 100 DIV2K validation images, spread over all GPUs; the
per-image scores are gathered so rank 0 can dump a per-image table.

    torchrun --nproc_per_node=8 train_imdn.py --train_hr data/DF2K/HR --train_lr data/DF2K/LR_bicubic/X4 \
        --val_hr data/DIV2K/DIV2K_valid_HR --val_lr data/DIV2K/DIV2K_valid_LR_bicubic/X4
"""
import argparse
import csv
import os
import random
import time
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from basicsr.metrics import calculate_psnr, calculate_ssim


def conv(cin, cout, k=3):
    return nn.Conv2d(cin, cout, k, 1, k // 2)


class CCALayer(nn.Module):
    """Contrast-aware channel attention."""

    def __init__(self, ch, reduction=16):
        super().__init__()
        self.fc = nn.Sequential(nn.Conv2d(ch, ch // reduction, 1), nn.ReLU(True),
                                nn.Conv2d(ch // reduction, ch, 1), nn.Sigmoid())

    def forward(self, x):
        mean = x.mean(dim=(2, 3), keepdim=True)
        std = (x - mean).pow(2).mean(dim=(2, 3), keepdim=True).sqrt()
        return x * self.fc(std + mean)


class IMDModule(nn.Module):
    def __init__(self, ch, distill=0.25):
        super().__init__()
        self.dc = int(ch * distill)
        self.rc = ch - self.dc
        self.c1 = conv(ch, ch)
        self.c2 = conv(self.rc, ch)
        self.c3 = conv(self.rc, ch)
        self.c4 = conv(self.rc, self.dc)
        self.act = nn.LeakyReLU(0.05, True)
        self.c5 = conv(self.dc * 4, ch, 1)
        self.cca = CCALayer(self.dc * 4)

    def forward(self, x):
        d1, r1 = torch.split(self.act(self.c1(x)), (self.dc, self.rc), dim=1)
        d2, r2 = torch.split(self.act(self.c2(r1)), (self.dc, self.rc), dim=1)
        d3, r3 = torch.split(self.act(self.c3(r2)), (self.dc, self.rc), dim=1)
        d4 = self.c4(r3)
        out = torch.cat([d1, d2, d3, d4], dim=1)
        return self.c5(self.cca(out)) + x


class IMDN(nn.Module):
    def __init__(self, scale=4, nf=64, nb=6):
        super().__init__()
        self.fea = conv(3, nf)
        self.blocks = nn.ModuleList([IMDModule(nf) for _ in range(nb)])
        self.fuse = nn.Sequential(conv(nf * nb, nf, 1), nn.LeakyReLU(0.05, True))
        self.lr_conv = conv(nf, nf)
        self.up = nn.Sequential(conv(nf, 3 * scale * scale), nn.PixelShuffle(scale))

    def forward(self, x):
        fea = self.fea(x)
        outs, h = [], fea
        for blk in self.blocks:
            h = blk(h)
            outs.append(h)
        out = self.lr_conv(self.fuse(torch.cat(outs, dim=1))) + fea
        return self.up(out)


class PatchSet(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, lr_patch):
        self.hr = sorted(Path(hr_dir).glob('*.png'))
        self.lr_dir = Path(lr_dir)
        self.scale, self.lp = scale, lr_patch

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hp = self.hr[i]
        hr = cv2.imread(str(hp))
        lr = cv2.imread(str(self.lr_dir / f'{hp.stem}x{self.scale}.png'))
        y = random.randint(0, lr.shape[0] - self.lp)
        x = random.randint(0, lr.shape[1] - self.lp)
        s = self.scale
        lr, hr = lr[y:y + self.lp, x:x + self.lp], hr[y * s:(y + self.lp) * s, x * s:(x + self.lp) * s]
        if random.random() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        if random.random() < 0.5:
            lr, hr = np.rot90(lr), np.rot90(hr)
        f = lambda a: torch.from_numpy(np.ascontiguousarray(a[..., ::-1].transpose(2, 0, 1))).float() / 255.
        return f(lr), f(hr)


@torch.no_grad()
def validate(net, hr_paths, lr_dir, scale, device, rank, world_size):
    net.eval()
    mine = hr_paths[rank::world_size]
    psnr, ssim = [], []
    for hp in mine:
        hr = cv2.imread(str(hp))
        lr = cv2.imread(str(Path(lr_dir) / f'{hp.stem}x{scale}.png'))
        inp = torch.from_numpy(np.ascontiguousarray(lr[..., ::-1].transpose(2, 0, 1))).float().div(255.)
        sr = net(inp.unsqueeze(0).to(device)).clamp(0, 1)[0]
        sr = (sr.cpu().numpy().transpose(1, 2, 0)[..., ::-1] * 255.).round().astype(np.uint8)
        psnr.append(calculate_psnr(sr, hr, crop_border=scale, test_y_channel=True))
        ssim.append(calculate_ssim(sr, hr, crop_border=scale, test_y_channel=True))
    net.train()
    local = torch.tensor([psnr, ssim], dtype=torch.float64, device=device)  # 2 x n_local
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered, dim=1).cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--train_hr', required=True)
    ap.add_argument('--train_lr', required=True)
    ap.add_argument('--val_hr', required=True)
    ap.add_argument('--val_lr', required=True)
    ap.add_argument('--scale', type=int, default=4)
    ap.add_argument('--lr_patch', type=int, default=64)
    ap.add_argument('--batch', type=int, default=16)
    ap.add_argument('--lr', type=float, default=2e-4)
    ap.add_argument('--iters', type=int, default=1000000)
    ap.add_argument('--val_every', type=int, default=10000)
    ap.add_argument('--out', default='runs/imdn_x4')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    random.seed(rank)
    np.random.seed(rank)

    train_set = PatchSet(args.train_hr, args.train_lr, args.scale, args.lr_patch)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_hr = sorted(Path(args.val_hr).glob('*.png'))

    net = DDP(IMDN(scale=args.scale).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=200000, gamma=0.5)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in net.parameters())
        print(f'IMDN x{args.scale}: {n_params / 1e3:.1f}K params | {len(train_set)} train | {len(val_hr)} val')

    it, ep, best = 0, 0, 0.0
    tic = time.time()
    while it < args.iters:
        sampler.set_epoch(ep)
        for lr_b, hr_b in loader:
            lr_b, hr_b = lr_b.to(device, non_blocking=True), hr_b.to(device, non_blocking=True)
            loss = F.l1_loss(net(lr_b), hr_b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 500 == 0:
                print(f'it {it} ep {ep} l1 {loss.item():.4f} {(time.time() - tic) / it * 1e3:.1f}ms/it', flush=True)

            if it % args.val_every == 0:
                scores = validate(net.module, val_hr, args.val_lr, args.scale, device, rank, world_size)
                if rank == 0:
                    mean_psnr, mean_ssim = scores[0].mean(), scores[1].mean()
                    print(f'[val {it}] PSNR {mean_psnr:.3f} SSIM {mean_ssim:.4f}', flush=True)
                    with open(os.path.join(args.out, f'val_{it}.csv'), 'w', newline='') as f:
                        w = csv.writer(f)
                        w.writerow(['idx', 'psnr', 'ssim'])
                        for i, (p, s) in enumerate(scores.T):
                            w.writerow([i, f'{p:.4f}', f'{s:.5f}'])
                    torch.save({'params': net.module.state_dict(), 'iter': it}, os.path.join(args.out, 'last.pth'))
                    if mean_psnr > best:
                        best = mean_psnr
                        torch.save({'params': net.module.state_dict(), 'iter': it},
                                   os.path.join(args.out, 'best.pth'))
                dist.barrier()
            if it >= args.iters:
                break
        ep += 1

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
