"""EDSR-baseline x4 super-resolution on DIV2K, multi-GPU.

train:  torchrun --nproc_per_node=4 20_edsr_div2k.py --dir_data /data/DIV2K --scale 4
At the end the best model is evaluated on Set5 / Set14 / B100 (Y-channel PSNR).
"""
import argparse
import glob
import math
import os
import random
import time

import imageio.v3 as iio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser(description='EDSR')
parser.add_argument('--dir_data', default='/data/DIV2K')
parser.add_argument('--dir_bench', default='/data/benchmark')
parser.add_argument('--scale', type=int, default=4)
parser.add_argument('--patch_size', type=int, default=192, help='HR patch size')
parser.add_argument('--n_resblocks', type=int, default=16)
parser.add_argument('--n_feats', type=int, default=64)
parser.add_argument('--batch_size', type=int, default=16, help='per GPU')
parser.add_argument('--epochs', type=int, default=300)
parser.add_argument('--repeat', type=int, default=20, help='passes over the 800 images per epoch')
parser.add_argument('--lr', type=float, default=1e-4)
parser.add_argument('--decay', type=int, default=200)
parser.add_argument('--save', default='experiment/edsr_baseline_x4')
parser.add_argument('--resume', action='store_true')
args = parser.parse_args()


class DIV2K(Dataset):
    def __init__(self, root, scale, patch, repeat):
        self.hr = sorted(glob.glob(os.path.join(root, 'DIV2K_train_HR', '*.png')))[:800]
        self.lr = [os.path.join(root, f'DIV2K_train_LR_bicubic/X{scale}', os.path.basename(p)[:-4] + f'x{scale}.png')
                   for p in self.hr]
        self.scale, self.patch, self.repeat = scale, patch, repeat

    def __len__(self):
        return len(self.hr) * self.repeat

    def __getitem__(self, idx):
        i = idx % len(self.hr)
        lr, hr = iio.imread(self.lr[i]), iio.imread(self.hr[i])
        lp = self.patch // self.scale
        y, x = random.randrange(lr.shape[0] - lp + 1), random.randrange(lr.shape[1] - lp + 1)
        lr = lr[y:y + lp, x:x + lp]
        hr = hr[y * self.scale:(y + lp) * self.scale, x * self.scale:(x + lp) * self.scale]
        if random.random() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        if random.random() < 0.5:
            lr, hr = lr[::-1], hr[::-1]
        if random.random() < 0.5:
            lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float()  # noqa: E731
        return to_t(lr), to_t(hr)


class MeanShift(nn.Conv2d):
    def __init__(self, rgb_range=255, sign=-1, mean=(0.4488, 0.4371, 0.4040)):
        super().__init__(3, 3, 1)
        self.weight.data = torch.eye(3).view(3, 3, 1, 1)
        self.bias.data = sign * rgb_range * torch.tensor(mean)
        for p in self.parameters():
            p.requires_grad = False


class ResBlock(nn.Module):
    def __init__(self, n, res_scale=1.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(n, n, 3, padding=1), nn.ReLU(True), nn.Conv2d(n, n, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, scale, n_resblocks=16, n_feats=64):
        super().__init__()
        self.sub_mean, self.add_mean = MeanShift(sign=-1), MeanShift(sign=1)
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_resblocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(n_feats, 3, 3, padding=1))

    def forward(self, x):
        x = self.head(self.sub_mean(x))
        x = self.body(x) + x
        return self.add_mean(self.tail(x))


def psnr_y(sr, hr, scale):
    sr, hr = sr.clamp(0, 255).round(), hr
    diff = (sr - hr) / 255.
    coef = torch.tensor([65.738, 129.057, 25.064], device=sr.device).view(1, 3, 1, 1) / 256
    diff = (diff * coef).sum(1)[..., scale:-scale, scale:-scale]
    return -10 * math.log10(diff.pow(2).mean().item())


@torch.no_grad()
def benchmark(net, name, device):
    hr_paths = sorted(glob.glob(os.path.join(args.dir_bench, name, 'HR', '*.png')))
    scores = []
    for p in hr_paths:
        lr_p = os.path.join(args.dir_bench, name, f'LR_bicubic/X{args.scale}',
                            os.path.basename(p)[:-4] + f'x{args.scale}.png')
        hr = torch.from_numpy(iio.imread(p)).permute(2, 0, 1)[None].float().to(device)
        lr = torch.from_numpy(iio.imread(lr_p)).permute(2, 0, 1)[None].float().to(device)
        sr = net(lr)
        hr = hr[..., :sr.shape[-2], :sr.shape[-1]]
        scores.append(psnr_y(sr, hr, args.scale))
    return float(np.mean(scores))


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    random.seed(100 + rank)

    ds = DIV2K(args.dir_data, args.scale, args.patch_size, args.repeat)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    model = EDSR(args.scale, args.n_resblocks, args.n_feats).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.decay, gamma=0.5)

    start_epoch, best_psnr = 0, 0.0
    ckpt_last = os.path.join(args.save, 'model', 'model_latest.pt')
    ckpt_best = os.path.join(args.save, 'model', 'model_best.pt')
    if args.resume and os.path.exists(ckpt_last):
        ck = torch.load(ckpt_last, map_location=device)
        model.load_state_dict(ck['model'])
        optimizer.load_state_dict(ck['optimizer'])
        scheduler.load_state_dict(ck['scheduler'])
        start_epoch, best_psnr = ck['epoch'] + 1, ck['best_psnr']

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.save, 'model'), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save, 'tb'))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for lr_img, hr_img in loader:
            lr_img, hr_img = lr_img.to(device, non_blocking=True), hr_img.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(acc)

        if rank == 0:
            net = model.module.eval()
            psnr = benchmark(net, 'Set5', device)
            print(f'[epoch {epoch + 1}] L1 {(acc[0] / acc[1]).item():.3f}  Set5 PSNR {psnr:.3f} dB '
                  f'(lr {scheduler.get_last_lr()[0]:.1e}, {time.time() - t0:.0f}s)')
            writer.add_scalar('train/l1', (acc[0] / acc[1]).item(), epoch)
            writer.add_scalar('val/set5_psnr', psnr, epoch)
            state = {'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                     'scheduler': scheduler.state_dict(), 'epoch': epoch, 'best_psnr': max(best_psnr, psnr)}
            torch.save(state, ckpt_last)
            if psnr > best_psnr:
                best_psnr = psnr
                torch.save(state, ckpt_best)
        dist.barrier()

    # final benchmark of the best checkpoint
    if rank == 0:
        net = EDSR(args.scale, args.n_resblocks, args.n_feats).to(device)
        net.load_state_dict(torch.load(ckpt_best, map_location=device)['model'])
        net.eval()
        for name in ('Set5', 'Set14', 'B100'):
            print(f'{name}: {benchmark(net, name, device):.3f} dB')
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
