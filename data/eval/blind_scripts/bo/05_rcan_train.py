"""RCAN (10 residual groups x 20 RCAB) bicubic x4 SR on DF2K, mixed precision.

    torchrun --nproc_per_node=4 train_rcan.py --data_root /data/DF2K --val_root /data/benchmark/Set14
"""
import argparse
import glob
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


# ----------------------------------------------------------------- model
class ChannelAttention(nn.Module):
    def __init__(self, nf, reduction=16):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(nn.Conv2d(nf, nf // reduction, 1), nn.ReLU(inplace=True),
                                nn.Conv2d(nf // reduction, nf, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.fc(self.pool(x))


class RCAB(nn.Module):
    def __init__(self, nf, reduction=16, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(nf, nf, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(nf, nf, 3, 1, 1),
                                  ChannelAttention(nf, reduction))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class ResidualGroup(nn.Module):
    def __init__(self, nf, n_rcab):
        super().__init__()
        self.body = nn.Sequential(*[RCAB(nf) for _ in range(n_rcab)], nn.Conv2d(nf, nf, 3, 1, 1))

    def forward(self, x):
        return x + self.body(x)


class RCAN(nn.Module):
    def __init__(self, scale=4, nf=64, n_groups=10, n_rcab=20, rgb_range=1.):
        super().__init__()
        self.rgb_range = rgb_range
        self.register_buffer('mean', torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[ResidualGroup(nf, n_rcab) for _ in range(n_groups)],
                                  nn.Conv2d(nf, nf, 3, 1, 1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(nf, 4 * nf, 3, 1, 1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(nf, 3, 3, 1, 1))

    def forward(self, x):
        x = (x - self.mean) * self.rgb_range
        x = self.head(x)
        x = x + self.body(x)
        return self.tail(x) / self.rgb_range + self.mean


# ------------------------------------------------------------------ data
class DF2KTrain(Dataset):
    def __init__(self, root, scale, patch, repeat=20):
        self.hr = sorted(glob.glob(os.path.join(root, 'HR', '*.png')))
        self.lr = sorted(glob.glob(os.path.join(root, f'LR_bicubic/X{scale}', '*.png')))
        assert len(self.hr) == len(self.lr), f'{len(self.hr)} HR vs {len(self.lr)} LR'
        self.scale, self.patch, self.repeat = scale, patch, repeat

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, i):
        i = i % len(self.hr)
        hr = cv2.imread(self.hr[i])[:, :, ::-1]
        lr = cv2.imread(self.lr[i])[:, :, ::-1]
        ps, s = self.patch, self.scale
        y, x = random.randrange(0, lr.shape[0] - ps + 1), random.randrange(0, lr.shape[1] - ps + 1)
        lr = lr[y:y + ps, x:x + ps]
        hr = hr[y * s:(y + ps) * s, x * s:(x + ps) * s]
        k = random.randint(0, 7)
        lr, hr = np.rot90(lr, k % 4), np.rot90(hr, k % 4)
        if k >= 4:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float() / 255.
        return to_t(lr), to_t(hr)


def rgb_to_y(img):
    return 16. + (65.481 * img[..., 0] + 128.553 * img[..., 1] + 24.966 * img[..., 2]) / 255.


def psnr_y(sr, hr, border):
    sr_y, hr_y = rgb_to_y(sr.astype(np.float64)), rgb_to_y(hr.astype(np.float64))
    sr_y, hr_y = sr_y[border:-border, border:-border], hr_y[border:-border, border:-border]
    mse = np.mean((sr_y - hr_y) ** 2)
    return 20 * math.log10(255. / math.sqrt(mse))


@torch.no_grad()
def evaluate(model, val_root, scale, device):
    model.eval()
    scores = []
    for hr_path in sorted(glob.glob(os.path.join(val_root, 'HR', '*.png'))):
        name = os.path.basename(hr_path)
        lr_path = os.path.join(val_root, f'LR_bicubic/X{scale}', name.replace('.png', f'x{scale}.png'))
        hr = cv2.imread(hr_path)[:, :, ::-1]
        lr = cv2.imread(lr_path)[:, :, ::-1]
        inp = torch.from_numpy(np.ascontiguousarray(lr.transpose(2, 0, 1))).float().div(255.).unsqueeze(0)
        sr = model(inp.to(device)).clamp(0, 1)
        sr = (sr[0].permute(1, 2, 0).cpu().numpy() * 255.).round()
        hr = hr[:sr.shape[0], :sr.shape[1]]
        scores.append(psnr_y(sr, hr, scale))
    model.train()
    return float(np.mean(scores))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--data_root', required=True)
    ap.add_argument('--val_root', required=True)
    ap.add_argument('--scale', type=int, default=4)
    ap.add_argument('--patch', type=int, default=48)
    ap.add_argument('--batch', type=int, default=16, help='per GPU')
    ap.add_argument('--lr', type=float, default=1e-4)
    ap.add_argument('--iters', type=int, default=300000)
    ap.add_argument('--decay_every', type=int, default=200000)
    ap.add_argument('--workers', type=int, default=6)
    ap.add_argument('--eval_every', type=int, default=5000)
    ap.add_argument('--ckpt_dir', default='checkpoints/rcan_x4')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    torch.manual_seed(1234 + rank)
    random.seed(1234 + rank)

    train_set = DF2KTrain(args.data_root, args.scale, args.patch)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    model = RCAN(scale=args.scale).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=args.decay_every, gamma=0.5)
    scaler = torch.cuda.amp.GradScaler()

    writer = SummaryWriter(os.path.join(args.ckpt_dir, 'logs')) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f'RCAN x{args.scale}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, '
              f'{len(train_set)} samples/epoch, {world} GPUs')

    step, epoch, best = 0, 0, 0.0
    tic = time.time()
    while step < args.iters:
        sampler.set_epoch(epoch)
        for lr_img, hr_img in loader:
            lr_img = lr_img.to(device, non_blocking=True)
            hr_img = hr_img.to(device, non_blocking=True)
            with torch.autocast('cuda', dtype=torch.float16):
                sr = model(lr_img)
            loss = F.l1_loss(sr.float(), hr_img)
            if not torch.isfinite(loss):
                if rank == 0:
                    print(f'non-finite loss at step {step}, skipping batch')
                optim.zero_grad(set_to_none=True)
                continue
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optim)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(optim)
            scaler.update()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                writer.add_scalar('loss/l1', loss.item(), step)
                writer.add_scalar('lr', sched.get_last_lr()[0], step)
                print(f'[{epoch}/{step}] l1={loss.item():.4f} scale={scaler.get_scale():.0f} '
                      f'{(time.time() - tic) / step:.3f}s/it')

            if step % args.eval_every == 0:
                if rank == 0:
                    score = evaluate(model.module, args.val_root, args.scale, device)
                    writer.add_scalar('val/psnr_y', score, step)
                    print(f'step {step}: Set14 PSNR-Y {score:.3f} dB')
                    state = {'model': model.module.state_dict(), 'optim': optim.state_dict(),
                             'sched': sched.state_dict(), 'scaler': scaler.state_dict(), 'step': step}
                    torch.save(state, os.path.join(args.ckpt_dir, 'last.pth'))
                    if score > best:
                        best = score
                        torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, 'best.pth'))
                dist.barrier()
            if step >= args.iters:
                break
        epoch += 1

    if rank == 0:
        writer.close()
        print(f'done, best PSNR-Y {best:.3f}')
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
