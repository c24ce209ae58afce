"""EDSR-baseline x3 with an EMA copy of the generator, iteration-based cosine schedule.

    torchrun --nproc_per_node=4 train_edsr_ema.py --cfg configs/edsr_baseline_x3.yaml
    torchrun --nproc_per_node=4 train_edsr_ema.py --cfg configs/edsr_baseline_x3.yaml \
        --resume experiments/edsr_baseline_x3/ckpt_latest.pth
"""
import argparse
import logging
import os
import os.path as osp
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.edsr_arch import EDSR
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.metrics import calculate_psnr, calculate_ssim
from basicsr.utils import tensor2img


class ModelEMA:
    def __init__(self, model, decay=0.999):
        self.ema = deepcopy(model).eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1. - self.decay)


def get_logger(out_dir, rank):
    logger = logging.getLogger('edsr_ema')
    if rank == 0:
        logger.setLevel(logging.INFO)
        fmt = logging.Formatter('%(asctime)s - %(message)s')
        for h in (logging.StreamHandler(), logging.FileHandler(osp.join(out_dir, 'train.log'))):
            h.setFormatter(fmt)
            logger.addHandler(h)
    else:
        logger.setLevel(logging.WARNING)
    return logger


@torch.no_grad()
def evaluate(net, loader, device, scale):
    net.eval()
    psnr = ssim = 0.0
    for data in loader:
        sr = tensor2img(net(data['lq'].to(device)))
        gt = tensor2img(data['gt'])
        psnr += calculate_psnr(sr, gt, crop_border=scale, test_y_channel=True)
        ssim += calculate_ssim(sr, gt, crop_border=scale, test_y_channel=True)
    return psnr / len(loader), ssim / len(loader)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg', required=True)
    parser.add_argument('--resume', default=None)
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f'cuda:{local_rank}')

    out_dir = osp.join('experiments', cfg['name'])
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    dist.barrier()
    logger = get_logger(out_dir, rank)
    random.seed(cfg['seed'] + rank)
    np.random.seed(cfg['seed'] + rank)
    torch.manual_seed(cfg['seed'])

    scale = cfg['scale']
    train_set = PairedImageDataset(dict(cfg['train'], phase='train', scale=scale))
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg['seed'])
    train_loader = DataLoader(train_set, batch_size=cfg['train']['batch_size_per_gpu'], sampler=sampler,
                              num_workers=cfg['train']['num_worker_per_gpu'], pin_memory=True, drop_last=True)
    val_loader = DataLoader(PairedImageDataset(dict(cfg['val'], phase='val', scale=scale)), batch_size=1)

    net = EDSR(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=16, upscale=scale, res_scale=1,
               img_range=255., rgb_mean=[0.4488, 0.4371, 0.4040])
    ema = ModelEMA(net, decay=cfg['ema_decay'])
    optimizer = torch.optim.Adam(net.parameters(), lr=cfg['lr'], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg['total_iter'], eta_min=1e-7)
    it, epoch, best_psnr = 0, 0, 0.0

    if args.resume:
        ckpt = torch.load(args.resume, map_location='cpu')
        net.load_state_dict(ckpt['net_g'], strict=True)
        ema.ema.load_state_dict(ckpt['net_g_ema'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        it, epoch, best_psnr = ckpt['iter'], ckpt['epoch'], ckpt.get('best_psnr', 0.0)
        logger.info(f'resumed from {args.resume} at iter {it}')

    net.to(device)
    ema.ema.to(device)
    for st in optimizer.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != 'step':
                st[k] = v.to(device)
    net_g = DDP(net, device_ids=[local_rank])
    criterion = nn.L1Loss().to(device)

    logger.info(f'{len(train_set)} training patches, {world_size} GPUs, '
                f'global batch {cfg["train"]["batch_size_per_gpu"] * world_size}')
    tic = time.time()
    while it < cfg['total_iter']:
        sampler.set_epoch(epoch)
        for data in train_loader:
            lq = data['lq'].to(device, non_blocking=True)
            gt = data['gt'].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(net_g(lq), gt)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema.update(net_g.module)
            it += 1

            if it % cfg['print_freq'] == 0:
                logger.info(f'ep {epoch} it {it} l1 {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} '
                            f'{(time.time() - tic) / cfg["print_freq"]:.3f}s/it')
                tic = time.time()

            if it % cfg['val_freq'] == 0:
                if rank == 0:
                    psnr, ssim = evaluate(ema.ema, val_loader, device, scale)
                    logger.info(f'[val it {it}] EMA PSNR {psnr:.3f} SSIM {ssim:.4f}')
                    is_best = psnr > best_psnr
                    best_psnr = max(psnr, best_psnr)
                    ckpt = {'net_g': net_g.state_dict(), 'net_g_ema': ema.ema.state_dict(),
                            'optimizer': optimizer.state_dict(), 'scheduler': scheduler.state_dict(),
                            'iter': it, 'epoch': epoch, 'best_psnr': best_psnr}
                    torch.save(ckpt, osp.join(out_dir, 'ckpt_latest.pth'))
                    if is_best:
                        torch.save(ema.ema.state_dict(), osp.join(out_dir, 'net_g_ema_best.pth'))
                dist.barrier()
            if it >= cfg['total_iter']:
                break
        epoch += 1

    if rank == 0:
        torch.save(ema.ema.state_dict(), osp.join(out_dir, 'net_g_ema_final.pth'))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
