#!/usr/bin/env python
"""EDSR (large, 32 res blocks, 256 feats) x2 on DIV2K sub-images stored in LMDB.

Prepare the LMDBs with scripts/data_preparation/create_lmdb.py first, then

    torchrun --nproc_per_node=4 train_edsr_lmdb.py --config configs/edsr_lx2_lmdb.yaml
"""
import argparse
import logging
import os
import os.path as osp
import random
import time

import cv2
import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.edsr_arch import EDSR
from basicsr.metrics import calculate_psnr, calculate_ssim
from basicsr.utils import img2tensor, tensor2img


class LMDBPairedDataset(Dataset):
    """GT / LQ sub-images (480x480 GT crops) in two LMDBs keyed by meta_info.txt."""

    def __init__(self, gt_lmdb, lq_lmdb, scale, gt_size, use_flip=True, use_rot=True):
        self.gt_lmdb, self.lq_lmdb = gt_lmdb, lq_lmdb
        self.scale, self.gt_size = scale, gt_size
        self.use_flip, self.use_rot = use_flip, use_rot
        with open(osp.join(gt_lmdb, 'meta_info.txt')) as f:
            self.keys = [line.split(' ')[0].split('.')[0] for line in f]
        # opened lazily inside each worker, an lmdb env cannot cross a fork
        self.gt_env = None
        self.lq_env = None

    def _open(self):
        self.gt_env = lmdb.open(self.gt_lmdb, readonly=True, lock=False, readahead=False, meminit=False)
        self.lq_env = lmdb.open(self.lq_lmdb, readonly=True, lock=False, readahead=False, meminit=False)

    @staticmethod
    def _read(env, key):
        with env.begin(write=False) as txn:
            buf = txn.get(key.encode('ascii'))
        img = cv2.imdecode(np.frombuffer(buf, np.uint8), cv2.IMREAD_COLOR)
        return img.astype(np.float32) / 255.

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, idx):
        if self.gt_env is None:
            self._open()
        key = self.keys[idx]
        img_gt = self._read(self.gt_env, key)
        img_lq = self._read(self.lq_env, key)
        lq_size = self.gt_size // self.scale
        h, w = img_lq.shape[:2]
        top, left = random.randint(0, h - lq_size), random.randint(0, w - lq_size)
        img_lq = img_lq[top:top + lq_size, left:left + lq_size]
        img_gt = img_gt[top * self.scale:top * self.scale + self.gt_size,
                        left * self.scale:left * self.scale + self.gt_size]
        if self.use_flip and random.random() < 0.5:
            img_lq, img_gt = cv2.flip(img_lq, 1), cv2.flip(img_gt, 1)
        if self.use_rot and random.random() < 0.5:
            img_lq, img_gt = img_lq.transpose(1, 0, 2), img_gt.transpose(1, 0, 2)
        img_gt, img_lq = img2tensor([img_gt, img_lq], bgr2rgb=True, float32=True)
        return {'lq': img_lq, 'gt': img_gt, 'key': key}


def build_logger(exp_dir, rank):
    logger = logging.getLogger('edsr')
    logger.propagate = False
    if rank != 0:
        logger.addHandler(logging.NullHandler())
        return logger
    logger.setLevel(logging.INFO)
    fmt = logging.Formatter('%(asctime)s %(levelname)s: %(message)s')
    for h in (logging.StreamHandler(), logging.FileHandler(osp.join(exp_dir, 'train.log'))):
        h.setFormatter(fmt)
        logger.addHandler(h)
    return logger


@torch.no_grad()
def validate(net, val_dir, scale, device):
    net.eval()
    hr_dir, lr_dir = osp.join(val_dir, 'HR'), osp.join(val_dir, f'LR_bicubic/X{scale}')
    psnr, ssim, names = 0.0, 0.0, sorted(os.listdir(hr_dir))
    for name in names:
        gt = cv2.imread(osp.join(hr_dir, name))
        lq = cv2.imread(osp.join(lr_dir, name.replace('.png', f'x{scale}.png'))).astype(np.float32) / 255.
        lq = img2tensor(lq, bgr2rgb=True, float32=True).unsqueeze(0).to(device)
        sr = tensor2img(net(lq))
        gt = gt[:sr.shape[0], :sr.shape[1]]
        psnr += calculate_psnr(sr, gt, crop_border=scale, test_y_channel=True)
        ssim += calculate_ssim(sr, gt, crop_border=scale, test_y_channel=True)
    net.train()
    return psnr / len(names), ssim / len(names)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--config', required=True)
    parser.add_argument('--resume', default=None, help='path to a .state file')
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl', init_method='env://')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    exp_dir = osp.join('experiments', cfg['name'])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, 'models'), exist_ok=True)
    dist.barrier()
    logger = build_logger(exp_dir, rank)

    seed = cfg.get('seed', 0)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    torch.backends.cudnn.benchmark = True

    dcfg = cfg['data']
    train_set = LMDBPairedDataset(dcfg['gt_lmdb'], dcfg['lq_lmdb'], cfg['scale'], dcfg['gt_size'])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(train_set, batch_size=dcfg['batch_size_per_gpu'], sampler=sampler,
                        num_workers=dcfg['num_workers'], pin_memory=True, drop_last=True,
                        persistent_workers=True, prefetch_factor=4)

    net = EDSR(num_in_ch=3, num_out_ch=3, num_feat=256, num_block=32, upscale=cfg['scale'],
               res_scale=0.1, img_range=255., rgb_mean=[0.4488, 0.4371, 0.4040]).to(device)
    net = DDP(net, device_ids=[local_rank], output_device=local_rank)
    criterion = nn.L1Loss()
    optimizer = torch.optim.Adam(net.parameters(), lr=cfg['train']['lr'], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg['train']['milestones'], gamma=0.5)

    current_iter, epoch = 0, 0
    if args.resume:
        state = torch.load(args.resume, map_location='cpu')
        net.module.load_state_dict(state['net'])
        optimizer.load_state_dict(state['optimizer'])
        scheduler.load_state_dict(state['scheduler'])
        current_iter, epoch = state['iter'], state['epoch']
        logger.info(f'Resumed from {args.resume} (iter {current_iter}, epoch {epoch})')

    total_iter = cfg['train']['total_iter']
    logger.info(f'{len(train_set)} sub-images, {len(loader)} iters / epoch on {world_size} GPUs')
    data_time, iter_time = 0.0, 0.0
    t = time.time()
    while current_iter < total_iter:
        for batch in loader:
            data_time += time.time() - t
            current_iter += 1
            lq = batch['lq'].to(device, non_blocking=True)
            gt = batch['gt'].to(device, non_blocking=True)

            optimizer.zero_grad(set_to_none=True)
            loss = criterion(net(lq), gt)
            loss.backward()
            optimizer.step()
            scheduler.step()
            iter_time += time.time() - t
            t = time.time()

            if current_iter % cfg['log']['print_freq'] == 0:
                pf = cfg['log']['print_freq']
                logger.info(f'[epoch {epoch:3d} iter {current_iter:7d}] l1 {loss.item():.5f} '
                            f'lr {scheduler.get_last_lr()[0]:.3e} time {iter_time / pf:.3f}s '
                            f'data {data_time / pf:.3f}s')
                data_time, iter_time = 0.0, 0.0

            if current_iter % cfg['log']['save_freq'] == 0:
                if rank == 0:
                    torch.save({'net': net.module.state_dict(), 'optimizer': optimizer.state_dict(),
                                'scheduler': scheduler.state_dict(), 'iter': current_iter, 'epoch': epoch},
                               osp.join(exp_dir, 'models', f'{current_iter}.state'))
                dist.barrier()

            if current_iter % cfg['val']['freq'] == 0:
                if rank == 0:
                    psnr, ssim = validate(net.module, cfg['val']['root'], cfg['scale'], device)
                    logger.info(f'[val {current_iter}] PSNR {psnr:.4f} SSIM {ssim:.4f}')
                dist.barrier()

            if current_iter >= total_iter:
                break
        epoch += 1

    if rank == 0:
        torch.save(net.module.state_dict(), osp.join(exp_dir, 'models', 'net_g_latest.pth'))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
