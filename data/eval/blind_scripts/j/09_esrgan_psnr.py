# RRDBNet x4 PSNR-oriented pretraining (ESRGAN stage 1) on DIV2K sub-images
# torchrun --nproc_per_node=4 09_esrgan_psnr.py --opt_name RRDB_PSNR_x4 --total_iter 1000000
import os
import os.path as osp
import math
import time
import glob
import random
import argparse
import logging

import cv2
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument('--opt_name', default='RRDB_PSNR_x4')
parser.add_argument('--gt_dir', default='datasets/DIV2K/DIV2K800_sub')
parser.add_argument('--lq_dir', default='datasets/DIV2K/DIV2K800_sub_bicLRx4')
parser.add_argument('--val_gt', default='datasets/Set14/GTmod12')
parser.add_argument('--val_lq', default='datasets/Set14/LRbicx4')
parser.add_argument('--scale', type=int, default=4)
parser.add_argument('--gt_size', type=int, default=128)
parser.add_argument('--batch_size_per_gpu', type=int, default=16)
parser.add_argument('--nf', type=int, default=64)
parser.add_argument('--nb', type=int, default=23)
parser.add_argument('--lr', type=float, default=2e-4)
parser.add_argument('--total_iter', type=int, default=1000000)
parser.add_argument('--period', type=int, default=250000)
parser.add_argument('--print_freq', type=int, default=100)
parser.add_argument('--save_freq', type=int, default=5000)
parser.add_argument('--resume', default=None)
args = parser.parse_args()

EXP_DIR = osp.join('experiments', args.opt_name)
logger = logging.getLogger('basicsr')


# ------------------------------------------------------------------ arch
class ResidualDenseBlock(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        x5 = self.conv5(torch.cat((x, x1, x2, x3, x4), 1))
        return x5 * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = ResidualDenseBlock(nf), ResidualDenseBlock(nf), ResidualDenseBlock(nf)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode='nearest')))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode='nearest')))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


# ------------------------------------------------------------------ data
def img2tensor(img):
    return torch.from_numpy(np.ascontiguousarray(img[:, :, ::-1].transpose(2, 0, 1))).float() / 255.


class PairedDataset(Dataset):
    def __init__(self, gt_dir, lq_dir, gt_size=None, scale=4, train=True):
        self.gt = sorted(glob.glob(osp.join(gt_dir, '*.png')))
        self.lq = sorted(glob.glob(osp.join(lq_dir, '*.png')))
        assert len(self.gt) == len(self.lq)
        self.gt_size, self.scale, self.train = gt_size, scale, train

    def __len__(self):
        return len(self.gt)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt[i], cv2.IMREAD_COLOR)
        lq = cv2.imread(self.lq[i], cv2.IMREAD_COLOR)
        if self.train:
            lq_size = self.gt_size // self.scale
            h, w = lq.shape[:2]
            top, left = random.randint(0, h - lq_size), random.randint(0, w - lq_size)
            lq = lq[top:top + lq_size, left:left + lq_size]
            gt = gt[top * self.scale:(top + lq_size) * self.scale, left * self.scale:(left + lq_size) * self.scale]
            if random.random() < 0.5:
                gt, lq = gt[:, ::-1], lq[:, ::-1]
            if random.random() < 0.5:
                gt, lq = gt[::-1], lq[::-1]
            if random.random() < 0.5:
                gt, lq = gt.transpose(1, 0, 2), lq.transpose(1, 0, 2)
        return img2tensor(lq), img2tensor(gt)


# ------------------------------------------------------------------ utils
def calc_psnr(sr, gt, crop=4):
    sr = sr[..., crop:-crop, crop:-crop].clamp(0, 1)
    gt = gt[..., crop:-crop, crop:-crop]
    mse = ((sr * 255).round() - gt * 255).pow(2).mean()
    return 10 * math.log10(255. ** 2 / max(mse.item(), 1e-10))


def save_training_state(net, optimizer, scheduler, current_iter):
    os.makedirs(osp.join(EXP_DIR, 'models'), exist_ok=True)
    os.makedirs(osp.join(EXP_DIR, 'training_states'), exist_ok=True)
    torch.save(net.module.state_dict(), osp.join(EXP_DIR, 'models', 'net_g_%d.pth' % current_iter))
    torch.save({'iter': current_iter, 'optimizer': optimizer.state_dict(), 'scheduler': scheduler.state_dict()},
               osp.join(EXP_DIR, 'training_states', '%d.state' % current_iter))
    torch.save(net.module.state_dict(), osp.join(EXP_DIR, 'models', 'net_g_latest.pth'))


@torch.no_grad()
def validation(net, val_set, rank, world, device):
    net.eval()
    psnr = torch.zeros(2, device=device)
    for i in range(rank, len(val_set), world):
        lq, gt = val_set[i]
        sr = net(lq[None].to(device))
        psnr[0] += calc_psnr(sr, gt[None].to(device))
        psnr[1] += 1
    dist.all_reduce(psnr)
    net.train()
    return (psnr[0] / psnr[1]).item()


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    if rank == 0:
        os.makedirs(EXP_DIR, exist_ok=True)
        logging.basicConfig(filename=osp.join(EXP_DIR, 'train.log'), level=logging.INFO,
                            format='%(asctime)s %(message)s')
        logger.addHandler(logging.StreamHandler())
    seed = 10 + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(10)

    train_set = PairedDataset(args.gt_dir, args.lq_dir, args.gt_size, args.scale, train=True)
    val_set = PairedDataset(args.val_gt, args.val_lq, train=False)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net_g = RRDBNet(args.nf, args.nb).to(device)
    net_g = DistributedDataParallel(net_g, device_ids=[local_rank])
    optimizer = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=args.period, eta_min=1e-7)
    current_iter = 0
    if args.resume:
        st = torch.load(args.resume, map_location=lambda s, l: s.cuda(local_rank))
        net_g.module.load_state_dict(torch.load(args.resume.replace('training_states', 'models')
                                                .replace('.state', '.pth').replace('/models/', '/models/net_g_'),
                                                map_location='cpu'))
        optimizer.load_state_dict(st['optimizer'])
        scheduler.load_state_dict(st['scheduler'])
        current_iter = st['iter']
    l1 = nn.L1Loss()

    epoch = current_iter // len(loader)
    t0 = time.time()
    while current_iter < args.total_iter:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            current_iter += 1
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = l1(net_g(lq), gt)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if current_iter % args.print_freq == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    logger.info('[epoch:%3d, iter:%8d, lr:%.3e] l_pix: %.4e  %.3fs/it', epoch, current_iter,
                                scheduler.get_last_lr()[0], l.item(), (time.time() - t0) / args.print_freq)
                t0 = time.time()
            if current_iter % args.save_freq == 0:
                save_training_state(net_g, optimizer, scheduler, current_iter)
                psnr = validation(net_g.module, val_set, rank, world, device)
                if rank == 0:
                    logger.info('Validation Set14 # psnr: %.4f', psnr)
            if current_iter >= args.total_iter:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == '__main__':
    main()
