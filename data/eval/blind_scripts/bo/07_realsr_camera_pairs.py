"""Real-world SR on camera-captured LR/HR pairs (RealSR-style, Canon + Nikon, x4).

The captured pairs come without an official validation split, so a fixed
number of scenes is held out for validation.

    torchrun --nproc_per_node=4 train_realsr_pairs.py --root /data/RealSR_V3 --scale 4
"""
import argparse
import glob
import json
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

from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.metrics.psnr_ssim import calculate_psnr, calculate_ssim
from basicsr.utils.matlab_functions import rgb2ycbcr


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument('--root', required=True)
    ap.add_argument('--scale', type=int, default=4)
    ap.add_argument('--n_val', type=int, default=30, help='number of held-out scenes')
    ap.add_argument('--gt_size', type=int, default=192)
    ap.add_argument('--batch_size', type=int, default=8)
    ap.add_argument('--num_workers', type=int, default=8)
    ap.add_argument('--lr', type=float, default=1e-4)
    ap.add_argument('--total_iter', type=int, default=200000)
    ap.add_argument('--milestones', type=int, nargs='+', default=[100000, 150000])
    ap.add_argument('--pretrained', default='weights/RRDB_PSNR_x4.pth')
    ap.add_argument('--out', default='experiments/realsr_rrdb_x4')
    ap.add_argument('--val_every', type=int, default=2000)
    ap.add_argument('--seed', type=int, default=2021)
    return ap.parse_args()


def list_pairs(root, scale):
    pairs = []
    for cam in ('Canon', 'Nikon'):
        for split in ('Train', 'Test'):
            for hr in sorted(glob.glob(os.path.join(root, cam, split, str(scale), '*_HR.png'))):
                lr = hr.replace('_HR.png', f'_LR{scale}.png')
                if os.path.exists(lr):
                    pairs.append((lr, hr))
    return pairs


class PairedCrops(Dataset):
    def __init__(self, pairs, scale, gt_size, train=True):
        self.pairs, self.scale, self.gt_size, self.train = pairs, scale, gt_size, train

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, idx):
        lr_path, hr_path = self.pairs[idx]
        hr = cv2.imread(hr_path, cv2.IMREAD_COLOR).astype(np.float32) / 255.
        lr = cv2.imread(lr_path, cv2.IMREAD_COLOR).astype(np.float32) / 255.
        if self.train:
            # RealSR LR images are upsampled back to HR size, so crops are aligned 1:1
            lr = cv2.resize(lr, (hr.shape[1] // self.scale, hr.shape[0] // self.scale), interpolation=cv2.INTER_CUBIC)
            ls = self.gt_size // self.scale
            y = random.randint(0, lr.shape[0] - ls)
            x = random.randint(0, lr.shape[1] - ls)
            lr = lr[y:y + ls, x:x + ls]
            hr = hr[y * self.scale:(y + ls) * self.scale, x * self.scale:(x + ls) * self.scale]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr[::-1], hr[::-1]
        else:
            lr = cv2.resize(lr, (hr.shape[1] // self.scale, hr.shape[0] // self.scale), interpolation=cv2.INTER_CUBIC)
            hr = hr[:lr.shape[0] * self.scale, :lr.shape[1] * self.scale]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a[:, :, ::-1].transpose(2, 0, 1)))
        return to_t(lr), to_t(hr), os.path.basename(hr_path)


def tensor_to_bgr_uint8(t):
    arr = t.detach().float().clamp(0, 1).cpu().numpy()[::-1].transpose(1, 2, 0)
    return (arr * 255.).round().astype(np.uint8)


def main():
    args = parse()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    # per-rank seed so random crops / flips differ between GPUs
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    all_pairs = list_pairs(args.root, args.scale)
    random.shuffle(all_pairs)
    val_pairs, train_pairs = all_pairs[:args.n_val], all_pairs[args.n_val:]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, 'split.json'), 'w') as f:
            json.dump({'val': [p[1] for p in val_pairs], 'train': [p[1] for p in train_pairs]}, f, indent=1)
        print(f'{len(train_pairs)} train pairs / {len(val_pairs)} val pairs, world size {world}')

    train_set = PairedCrops(train_pairs, args.scale, args.gt_size, train=True)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(PairedCrops(val_pairs, args.scale, args.gt_size, train=False), batch_size=1)

    net = RRDBNet(3, 3, num_feat=64, num_block=23, num_grow_ch=32, scale=args.scale)
    if os.path.isfile(args.pretrained):
        sd = torch.load(args.pretrained, map_location='cpu')
        net.load_state_dict(sd.get('params', sd), strict=True)
    net = DDP(net.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.5)
    l1 = nn.L1Loss()

    it, epoch, best_psnr = 0, 0, 0.0
    t0 = time.time()
    while it < args.total_iter:
        sampler.set_epoch(epoch)
        for lr_t, hr_t, _ in loader:
            lr_t, hr_t = lr_t.to(device, non_blocking=True), hr_t.to(device, non_blocking=True)
            loss = l1(net(lr_t), hr_t)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if rank == 0 and it % 100 == 0:
                print(f'it {it:6d} | ep {epoch} | l1 {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e} | '
                      f'{(time.time() - t0) / it:.3f} s/it', flush=True)

            if it % args.val_every == 0:
                if rank == 0:
                    model = net.module
                    model.eval()
                    psnrs, ssims = [], []
                    with torch.no_grad():
                        for lr_v, hr_v, _ in val_loader:
                            sr = model(lr_v.to(device))
                            sr_img = tensor_to_bgr_uint8(sr[0])
                            hr_img = tensor_to_bgr_uint8(hr_v[0])
                            psnrs.append(calculate_psnr(sr_img, hr_img, crop_border=args.scale, test_y_channel=True))
                            ssims.append(calculate_ssim(sr_img, hr_img, crop_border=args.scale, test_y_channel=True))
                    model.train()
                    cur = float(np.mean(psnrs))
                    print(f'[val] it {it}: PSNR-Y {cur:.3f}  SSIM-Y {np.mean(ssims):.4f}', flush=True)
                    ckpt = {'params': model.state_dict(), 'iter': it, 'psnr': cur}
                    torch.save(ckpt, os.path.join(args.out, 'latest.pth'))
                    if cur > best_psnr:
                        best_psnr = cur
                        torch.save(ckpt, os.path.join(args.out, 'best.pth'))
                dist.barrier()
            if it >= args.total_iter:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
