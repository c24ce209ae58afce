"""Real-ESRNet x4 (L1 only, first stage of Real-ESRGAN) with the degradation pipeline
inside the Dataset, so that each sample gets its own kernels / noise / JPEG quality.

    torchrun --nproc_per_node=4 train_realesrnet.py --opt options/realesrnet_x4plus.yml
"""
import argparse
import math
import os
import os.path as osp
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.data.degradations import (circular_lowpass_kernel, random_add_gaussian_noise_pt,
                                       random_add_poisson_noise_pt, random_mixed_kernels)
from basicsr.utils import DiffJPEG, USMSharp, get_root_logger, img2tensor
from basicsr.utils.img_process_util import filter2D


class OnlineDegradationDataset(Dataset):
    """Reads a GT crop and synthesises its LQ counterpart (blur -> resize -> noise -> JPEG, twice)."""

    def __init__(self, opt, device):
        self.opt = opt
        self.device = device
        with open(opt['meta_info']) as f:
            self.paths = [osp.join(opt['dataroot_gt'], line.strip().split(' ')[0]) for line in f]
        self.jpeger = DiffJPEG(differentiable=False).to(device)
        self.usm = USMSharp().to(device)
        self.kernel_range = [2 * v + 1 for v in range(3, 11)]

    def __len__(self):
        return len(self.paths)

    def _kernel(self, sinc_prob, kernel_list, kernel_prob, sigma):
        ks = random.choice(self.kernel_range)
        if np.random.uniform() < sinc_prob:
            omega_c = np.random.uniform(np.pi / 3, np.pi) if ks < 13 else np.random.uniform(np.pi / 5, np.pi)
            k = circular_lowpass_kernel(omega_c, ks, pad_to=False)
        else:
            k = random_mixed_kernels(kernel_list, kernel_prob, ks, sigma, sigma, [-math.pi, math.pi],
                                     [0.5, 4], [1, 2], noise_range=None)
        pad = (21 - ks) // 2
        return torch.FloatTensor(np.pad(k, ((pad, pad), (pad, pad))))

    def __getitem__(self, index):
        opt = self.opt
        img_gt = cv2.imread(self.paths[index], cv2.IMREAD_COLOR).astype(np.float32) / 255.
        h, w = img_gt.shape[:2]
        crop = opt['gt_size']
        top, left = random.randint(0, max(0, h - crop)), random.randint(0, max(0, w - crop))
        img_gt = img_gt[top:top + crop, left:left + crop]
        if random.random() < 0.5:
            img_gt = cv2.flip(img_gt, 1)
        gt = img2tensor(img_gt, bgr2rgb=True, float32=True).unsqueeze(0).to(self.device)

        k1 = self._kernel(0.1, opt['kernel_list'], opt['kernel_prob'], opt['blur_sigma']).to(self.device)
        k2 = self._kernel(0.1, opt['kernel_list'], opt['kernel_prob'], opt['blur_sigma2']).to(self.device)
        with torch.no_grad():
            gt_usm = self.usm(gt)
            out = filter2D(gt_usm, k1.unsqueeze(0))
            out = F.interpolate(out, scale_factor=np.random.uniform(0.15, 1.5), mode='bicubic')
            out = random_add_gaussian_noise_pt(out, sigma_range=[1, 30], clip=True, rounds=False, gray_prob=0.4)
            out = self.jpeger(out.clamp(0, 1), quality=out.new_tensor([np.random.uniform(30, 95)]))
            if np.random.uniform() < 0.8:
                out = filter2D(out, k2.unsqueeze(0))
            out = F.interpolate(out, scale_factor=np.random.uniform(0.3, 1.2), mode='bilinear')
            out = random_add_poisson_noise_pt(out, scale_range=[0.05, 2.5], gray_prob=0.4, clip=True, rounds=False)
            out = F.interpolate(out, size=(crop // opt['scale'], crop // opt['scale']), mode='bicubic')
            out = self.jpeger(out.clamp(0, 1), quality=out.new_tensor([np.random.uniform(30, 95)]))
            lq = (out.clamp(0, 1) * 255.).round() / 255.
        return {'lq': lq.squeeze(0).cpu(), 'gt': gt_usm.squeeze(0).cpu()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--opt', required=True)
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = yaml.safe_load(f)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    exp_dir = osp.join('experiments', opt['name'])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, 'models'), exist_ok=True)
    dist.barrier()
    logger = get_root_logger(log_file=osp.join(exp_dir, 'train.log'))
    seed = opt['manual_seed'] + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    data_opt = dict(opt['datasets']['train'], scale=opt['scale'])
    train_set = OnlineDegradationDataset(data_opt, device)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=data_opt['batch_size_per_gpu'], sampler=train_sampler,
                              num_workers=data_opt.get('num_worker_per_gpu', 6), drop_last=True, pin_memory=False)

    net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=opt['scale'])
    pretrained = torch.load(opt['path']['pretrain_network_g'], map_location='cpu')
    net_g.load_state_dict(pretrained['params_ema'] if 'params_ema' in pretrained else pretrained['params'])
    net_g = DDP(net_g.to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(net_g.parameters(), lr=opt['train']['lr'], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, opt['train']['milestones'], gamma=0.5)

    total_iter = opt['train']['total_iter']
    epochs = math.ceil(total_iter / len(train_loader))
    logger.info(f'{len(train_set)} GT images, {len(train_loader)} iters/epoch, {epochs} epochs')
    current_iter, t0 = 0, time.time()
    for epoch in range(epochs + 1):
        train_sampler.set_epoch(epoch)
        for data in train_loader:
            current_iter += 1
            if current_iter > total_iter:
                break
            lq = data['lq'].to(device, non_blocking=True)
            gt = data['gt'].to(device, non_blocking=True)
            optimizer.zero_grad()
            l_pix = F.l1_loss(net_g(lq), gt)
            l_pix.backward()
            optimizer.step()
            scheduler.step()
            if current_iter % opt['logger']['print_freq'] == 0:
                logger.info(f'[ep {epoch}, it {current_iter}] l_pix {l_pix.item():.4e} '
                            f'lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / current_iter:.2f}s/it')
            if current_iter % opt['logger']['save_checkpoint_freq'] == 0:
                if rank == 0:
                    torch.save({'params': net_g.module.state_dict()},
                               osp.join(exp_dir, 'models', f'net_g_{current_iter}.pth'))
                    torch.save({'iter': current_iter, 'epoch': epoch, 'optimizer': optimizer.state_dict(),
                                'scheduler': scheduler.state_dict()},
                               osp.join(exp_dir, 'models', f'{current_iter}.state'))
                dist.barrier()
        if current_iter > total_iter:
            break

    if rank == 0:
        torch.save({'params': net_g.module.state_dict()}, osp.join(exp_dir, 'models', 'net_g_latest.pth'))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
