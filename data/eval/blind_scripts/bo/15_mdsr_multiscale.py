"""MDSR: one shared body with scale-specific heads / tails, trained jointly for x2, x3, x4.

Every iteration draws one scale; the LR patch is produced on the GPU by bicubic
down-sampling of the HR crop (antialiased), as in the EDSR/MDSR multi-scale recipe.

    torchrun --nproc_per_node=4 train_mdsr.py --hr_dir data/DIV2K/DIV2K_train_HR --val_dir data/Set14
"""
import argparse
import glob
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

from basicsr.metrics import calculate_psnr

SCALES = (2, 3, 4)


class ResBlock(nn.Module):
    def __init__(self, nf, k=3, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(nf, nf, k, 1, k // 2), nn.ReLU(True), nn.Conv2d(nf, nf, k, 1, k // 2))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class Upsampler(nn.Sequential):
    def __init__(self, scale, nf):
        layers = []
        if scale in (2, 4):
            for _ in range(scale // 2):
                layers += [nn.Conv2d(nf, 4 * nf, 3, 1, 1), nn.PixelShuffle(2)]
        elif scale == 3:
            layers += [nn.Conv2d(nf, 9 * nf, 3, 1, 1), nn.PixelShuffle(3)]
        super().__init__(*layers)


class MDSR(nn.Module):
    def __init__(self, scales=SCALES, nf=64, n_blocks=80):
        super().__init__()
        self.scales = scales
        self.register_buffer('rgb_mean', torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, nf, 3, 1, 1)
        self.pre_process = nn.ModuleList([nn.Sequential(ResBlock(nf, 5), ResBlock(nf, 5)) for _ in scales])
        self.body = nn.Sequential(*[ResBlock(nf) for _ in range(n_blocks)], nn.Conv2d(nf, nf, 3, 1, 1))
        self.upsample = nn.ModuleList([Upsampler(s, nf) for s in scales])
        self.tail = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x, scale_idx):
        x = (x - self.rgb_mean) * 255.
        x = self.pre_process[scale_idx](self.head(x))
        x = x + self.body(x)
        x = self.tail(self.upsample[scale_idx](x))
        return x / 255. + self.rgb_mean


class HRCrops(Dataset):
    """Returns a 192x192 HR crop; 192 is divisible by 2, 3 and 4."""

    def __init__(self, hr_dir, crop=192, repeat=10):
        self.paths = sorted(glob.glob(os.path.join(hr_dir, '*.png')))
        self.crop, self.repeat = crop, repeat

    def __len__(self):
        return len(self.paths) * self.repeat

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i % len(self.paths)], cv2.IMREAD_COLOR)
        h, w = img.shape[:2]
        y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        img = img[y:y + self.crop, x:x + self.crop, ::-1]
        if random.random() < 0.5:
            img = img[:, ::-1]
        if random.random() < 0.5:
            img = img.transpose(1, 0, 2)
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))).float() / 255.


def downsample(hr, scale):
    lr = F.interpolate(hr, scale_factor=1.0 / scale, mode='bicubic', align_corners=False, antialias=True)
    return (lr.clamp(0, 1) * 255.).round() / 255.


@torch.no_grad()
def validate(model, val_dir, device):
    model.eval()
    res = {}
    paths = sorted(glob.glob(os.path.join(val_dir, 'HR', '*.png')))
    for si, s in enumerate(SCALES):
        vals = []
        for p in paths:
            hr = cv2.imread(p)
            h, w = (hr.shape[0] // s) * s, (hr.shape[1] // s) * s
            hr = hr[:h, :w]
            t = torch.from_numpy(np.ascontiguousarray(hr[..., ::-1].transpose(2, 0, 1))).float().div(255.)
            lr = downsample(t.unsqueeze(0).to(device), s)
            sr = model(lr, si).clamp(0, 1)[0].cpu().numpy().transpose(1, 2, 0)[..., ::-1]
            sr = (sr * 255.).round().astype(np.uint8)
            vals.append(calculate_psnr(sr, hr, crop_border=s, test_y_channel=True))
        res[f'x{s}'] = float(np.mean(vals))
    model.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--hr_dir', required=True)
    ap.add_argument('--val_dir', required=True)
    ap.add_argument('--batch', type=int, default=16)
    ap.add_argument('--lr', type=float, default=1e-4)
    ap.add_argument('--iters', type=int, default=650000)
    ap.add_argument('--half_every', type=int, default=200000)
    ap.add_argument('--val_every', type=int, default=10000)
    ap.add_argument('--out', default='experiments/mdsr')
    ap.add_argument('--seed', type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    ds = HRCrops(args.hr_dir)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    model = MDSR().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.half_every, gamma=0.5)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f'MDSR {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, scales {SCALES}, '
              f'{world} GPUs x {args.batch}')

    it, epoch, t0 = 0, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for hr in loader:
            hr = hr.to(device, non_blocking=True)
            scale_idx = random.randrange(len(SCALES))
            lr = downsample(hr, SCALES[scale_idx])
            sr = model(lr, scale_idx)
            loss = F.l1_loss(sr, hr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if rank == 0 and it % 200 == 0:
                print(f'it {it} x{SCALES[scale_idx]} l1 {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} '
                      f'{(time.time() - t0) / it:.3f}s/it', flush=True)
            if it % args.val_every == 0:
                if rank == 0:
                    res = validate(model.module, args.val_dir, device)
                    print(f'[val {it}] ' + ' '.join(f'{k}: {v:.3f}' for k, v in res.items()), flush=True)
                    torch.save({'params': model.module.state_dict(), 'iter': it, 'psnr': res},
                               os.path.join(args.out, f'mdsr_{it}.pth'))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save({'params': model.module.state_dict(), 'iter': it}, os.path.join(args.out, 'mdsr_final.pth'))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
