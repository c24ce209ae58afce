"""SwinIR for grayscale JPEG compression artifact reduction (quality 10/20/30/40).

Training pairs are compressed on the fly with OpenCV; validation uses the
classic5 + LIVE1 images compressed at --val_quality, spread over all GPUs.

    torchrun --nproc_per_node=4 train_swinir_car.py --train_dir data/DFWB --val_dirs data/classic5 data/LIVE1
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from basicsr.archs.swinir_arch import SwinIR
from basicsr.metrics.psnr_ssim import calculate_psnr, calculate_ssim


def jpeg(img_u8, quality):
    ok, buf = cv2.imencode('.jpg', img_u8, [int(cv2.IMWRITE_JPEG_QUALITY), int(quality)])
    assert ok
    return cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)


class JPEGTrain(Dataset):
    def __init__(self, root, patch=126, qualities=(10, 20, 30, 40)):
        exts = ('*.png', '*.bmp', '*.jpg')
        self.paths = sorted(p for e in exts for p in glob.glob(os.path.join(root, '**', e), recursive=True))
        self.patch, self.qualities = patch, qualities

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = cv2.imread(self.paths[i], cv2.IMREAD_GRAYSCALE)
        h, w = img.shape
        if min(h, w) < self.patch:
            img = cv2.copyMakeBorder(img, 0, max(0, self.patch - h), 0, max(0, self.patch - w), cv2.BORDER_REFLECT)
            h, w = img.shape
        y, x = random.randint(0, h - self.patch), random.randint(0, w - self.patch)
        gt = img[y:y + self.patch, x:x + self.patch]
        k = random.randint(0, 7)
        gt = np.rot90(gt, k % 4)
        if k > 3:
            gt = gt[:, ::-1]
        gt = np.ascontiguousarray(gt)
        lq = jpeg(gt, random.choice(self.qualities))
        t = lambda a: torch.from_numpy(a.astype(np.float32) / 255.).unsqueeze(0)
        return t(lq), t(gt)


class JPEGVal(Dataset):
    def __init__(self, dirs, quality):
        self.paths = sorted(p for d in dirs for p in glob.glob(os.path.join(d, '*')))
        self.quality = quality

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        gt = cv2.imread(self.paths[i], cv2.IMREAD_GRAYSCALE)
        lq = jpeg(gt, self.quality)
        t = lambda a: torch.from_numpy(a.astype(np.float32) / 255.).unsqueeze(0)
        return t(lq), t(gt)


@torch.no_grad()
def restore(net, lq, window_size=7):
    _, _, h, w = lq.shape
    ph, pw = (window_size - h % window_size) % window_size, (window_size - w % window_size) % window_size
    out = net(F.pad(lq, (0, pw, 0, ph), mode='reflect'))
    return out[..., :h, :w]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--train_dir', required=True)
    ap.add_argument('--val_dirs', nargs='+', required=True)
    ap.add_argument('--val_quality', type=int, default=10)
    ap.add_argument('--batch_size', type=int, default=2, help='per GPU')
    ap.add_argument('--lr', type=float, default=2e-4)
    ap.add_argument('--total_iter', type=int, default=800000)
    ap.add_argument('--milestones', type=int, nargs='+', default=[400000, 600000, 700000, 750000])
    ap.add_argument('--val_freq', type=int, default=5000)
    ap.add_argument('--out', default='experiments/swinir_car_gray')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    random.seed(123 + rank)
    np.random.seed(123 + rank)
    torch.manual_seed(123)
    cv2.setNumThreads(0)

    train_set = JPEGTrain(args.train_dir)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_set = JPEGVal(args.val_dirs, args.val_quality)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    net = SwinIR(upscale=1, in_chans=1, img_size=126, window_size=7, img_range=255.,
                 depths=[6, 6, 6, 6, 6, 6], embed_dim=180, num_heads=[6, 6, 6, 6, 6, 6],
                 mlp_ratio=2, upsampler='', resi_connection='1conv').to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.5)
    writer = SummaryWriter(os.path.join(args.out, 'tb')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f'train {len(train_set)} | val {len(val_set)} (q={args.val_quality}) | {world} GPUs', flush=True)

    it, epoch, best_psnr = 0, 0, 0.0
    tic = time.time()
    while it < args.total_iter:
        train_sampler.set_epoch(epoch)
        for lq, gt in train_loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            # Charbonnier loss, as in the SwinIR CAR setting
            loss = torch.sqrt((model(lq) - gt) ** 2 + 1e-6).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                writer.add_scalar('train/charbonnier', loss.item(), it)
                print(f'[{it}] loss {loss.item():.5f} lr {scheduler.get_last_lr()[0]:.2e} '
                      f'{(time.time() - tic) / it:.3f}s/it', flush=True)

            if it % args.val_freq == 0:
                net.eval()
                psnrs, ssims = [], []
                for v_lq, v_gt in val_loader:
                    out = restore(net, v_lq.to(device))
                    out_u8 = (out[0, 0].clamp(0, 1).cpu().numpy() * 255.).round().astype(np.uint8)
                    gt_u8 = (v_gt[0, 0].numpy() * 255.).round().astype(np.uint8)
                    psnrs.append(calculate_psnr(out_u8, gt_u8, crop_border=0))
                    ssims.append(calculate_ssim(out_u8, gt_u8, crop_border=0))
                net.train()
                val_psnr, val_ssim = float(np.mean(psnrs)), float(np.mean(ssims))
                if rank == 0:
                    writer.add_scalar('val/psnr', val_psnr, it)
                    writer.add_scalar('val/ssim', val_ssim, it)
                    print(f'[val {it}] q{args.val_quality} PSNR {val_psnr:.3f} SSIM {val_ssim:.4f}', flush=True)
                    torch.save({'params': net.state_dict(), 'iter': it}, os.path.join(args.out, 'latest.pth'))
                    if val_psnr > best_psnr:
                        best_psnr = val_psnr
                        torch.save({'params': net.state_dict(), 'iter': it}, os.path.join(args.out, 'best.pth'))
                dist.barrier()
            if it >= args.total_iter:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
