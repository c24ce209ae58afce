"""ESRGAN-style x4 GAN training launched with torch.multiprocessing.spawn (single node).

    python train_esrgan_spawn.py --gpus 4 --train_gt data/DF2K_sub/GT --train_lq data/DF2K_sub/LQx4 \
        --val_root data/Set14 --pretrain weights/RRDB_PSNR_x4.pth
"""
import argparse
import os
import random
import time
from copy import deepcopy

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.discriminator_arch import VGGStyleDiscriminator
from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.metrics import calculate_psnr


class SubImagePairs(Dataset):
    def __init__(self, gt_dir, lq_dir, scale=4, gt_size=128):
        self.names = sorted(os.listdir(gt_dir))
        self.gt_dir, self.lq_dir, self.scale, self.gt_size = gt_dir, lq_dir, scale, gt_size

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        gt = cv2.imread(os.path.join(self.gt_dir, self.names[i])).astype(np.float32) / 255.
        lq = cv2.imread(os.path.join(self.lq_dir, self.names[i])).astype(np.float32) / 255.
        ls = self.gt_size // self.scale
        y, x = random.randint(0, lq.shape[0] - ls), random.randint(0, lq.shape[1] - ls)
        lq = lq[y:y + ls, x:x + ls]
        gt = gt[y * self.scale:y * self.scale + self.gt_size, x * self.scale:x * self.scale + self.gt_size]
        if random.random() < 0.5:
            lq, gt = lq[:, ::-1], gt[:, ::-1]
        if random.random() < 0.5:
            lq, gt = lq.transpose(1, 0, 2), gt.transpose(1, 0, 2)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a[..., ::-1].transpose(2, 0, 1)))
        return t(lq), t(gt)


class VGGPerceptual(nn.Module):
    """L1 on VGG19 conv5_4 features (before ReLU), ImageNet-normalised inputs."""

    def __init__(self):
        super().__init__()
        vgg = torchvision.models.vgg19(weights=torchvision.models.VGG19_Weights.IMAGENET1K_V1)
        self.features = vgg.features[:35].eval()
        for p in self.features.parameters():
            p.requires_grad = False
        self.register_buffer('mean', torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer('std', torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        fx = self.features((x - self.mean) / self.std)
        fg = self.features((gt.detach() - self.mean) / self.std)
        return F.l1_loss(fx, fg)


def bce_with_logits(pred, target_is_real):
    target = torch.ones_like(pred) if target_is_real else torch.zeros_like(pred)
    return F.binary_cross_entropy_with_logits(pred, target)


@torch.no_grad()
def run_val(net, val_root, device):
    names = sorted(os.listdir(os.path.join(val_root, 'HR')))
    psnr = 0.0
    for n in names:
        hr = cv2.imread(os.path.join(val_root, 'HR', n))
        lr = cv2.imread(os.path.join(val_root, 'LR_bicubic/X4', n.replace('.png', 'x4.png')))
        inp = torch.from_numpy(np.ascontiguousarray(lr[..., ::-1].transpose(2, 0, 1))).float().div(255.)
        sr = net(inp.unsqueeze(0).to(device)).clamp(0, 1)[0].cpu().numpy()
        sr = (sr.transpose(1, 2, 0)[..., ::-1] * 255.).round().astype(np.uint8)
        psnr += calculate_psnr(sr, hr[:sr.shape[0], :sr.shape[1]], crop_border=4, test_y_channel=True)
    return psnr / len(names)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', init_method='env://', rank=rank, world_size=world_size)
    device = torch.device('cuda', rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    train_set = SubImagePairs(args.train_gt, args.train_lq)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net_g = RRDBNet(3, 3, num_feat=64, num_block=23, num_grow_ch=32, scale=4)
    net_g.load_state_dict(torch.load(args.pretrain, map_location='cpu')['params'])
    net_g = net_g.to(device)
    net_g_ema = deepcopy(net_g).eval().requires_grad_(False)
    # per-GPU batch is small (4 patches), so the discriminator's BatchNorm is synchronised across ranks
    net_d = nn.SyncBatchNorm.convert_sync_batchnorm(VGGStyleDiscriminator(num_in_ch=3, num_feat=64)).to(device)
    net_g = DDP(net_g, device_ids=[rank])
    net_d = DDP(net_d, device_ids=[rank])

    # download the VGG weights once, the other ranks read them from the torch hub cache
    if rank == 0:
        cri_percep = VGGPerceptual().to(device)
    dist.barrier()
    if rank != 0:
        cri_percep = VGGPerceptual().to(device)

    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-4, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-4, betas=(0.9, 0.99))
    sch_g = torch.optim.lr_scheduler.MultiStepLR(opt_g, [50000, 100000, 200000, 300000], 0.5)
    sch_d = torch.optim.lr_scheduler.MultiStepLR(opt_d, [50000, 100000, 200000, 300000], 0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    it, epoch, tic = 0, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            it += 1
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)

            # ---------------- G ----------------
            for p in net_d.parameters():
                p.requires_grad = False
            opt_g.zero_grad()
            out = net_g(lq)
            l_pix = 1e-2 * F.l1_loss(out, gt)
            l_per = cri_percep(out, gt)
            real_pred = net_d(gt).detach()
            fake_pred = net_d(out)
            l_gan = 5e-3 * (bce_with_logits(real_pred - fake_pred.mean(), False) +
                            bce_with_logits(fake_pred - real_pred.mean(), True)) / 2
            (l_pix + l_per + l_gan).backward()
            opt_g.step()

            # ---------------- D ----------------
            # real and fake get their own backward: a second forward through net_d
            # before backward would re-broadcast its buffers in place under DDP
            for p in net_d.parameters():
                p.requires_grad = True
            opt_d.zero_grad()
            fake_pred = net_d(out).detach()
            real_pred = net_d(gt)
            l_d_real = bce_with_logits(real_pred - fake_pred.mean(), True) * 0.5
            l_d_real.backward()
            fake_pred = net_d(out.detach())
            l_d_fake = bce_with_logits(fake_pred - real_pred.detach().mean(), False) * 0.5
            l_d_fake.backward()
            opt_d.step()
            sch_g.step()
            sch_d.step()

            with torch.no_grad():
                for pe, p in zip(net_g_ema.parameters(), net_g.module.parameters()):
                    pe.mul_(0.999).add_(p, alpha=0.001)

            if rank == 0 and it % 100 == 0:
                print(f'[{it}] pix {l_pix.item():.4f} per {l_per.item():.4f} gan {l_gan.item():.4f} '
                      f'd_real {l_d_real.item():.4f} d_fake {l_d_fake.item():.4f} '
                      f'{(time.time() - tic) / it:.2f}s/it', flush=True)
            if it % args.save_every == 0:
                if rank == 0:
                    psnr = run_val(net_g_ema, args.val_root, device)
                    print(f'[{it}] Set14 PSNR (EMA) {psnr:.3f}', flush=True)
                    torch.save({'params': net_g.module.state_dict(), 'params_ema': net_g_ema.state_dict()},
                               os.path.join(args.out, f'net_g_{it}.pth'))
                    torch.save({'params': net_d.module.state_dict()}, os.path.join(args.out, f'net_d_{it}.pth'))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--gpus', type=int, default=torch.cuda.device_count())
    ap.add_argument('--train_gt', required=True)
    ap.add_argument('--train_lq', required=True)
    ap.add_argument('--val_root', required=True)
    ap.add_argument('--pretrain', required=True)
    ap.add_argument('--batch_size', type=int, default=4)
    ap.add_argument('--workers', type=int, default=4)
    ap.add_argument('--iters', type=int, default=400000)
    ap.add_argument('--save_every', type=int, default=5000)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--out', default='experiments/esrgan_spawn')
    ap.add_argument('--port', default='29517')
    args = ap.parse_args()

    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', args.port)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == '__main__':
    main()
