"""Real-ESRGAN x4 training (GAN stage) with on-the-fly second-order degradations.

The dataset only loads GT crops plus blur kernels; the rest of the degradation
(blur, resize, noise, JPEG, second pass) runs on the GPU in `feed_data`, as in
the official implementation.

    torchrun --nproc_per_node=4 --master_port=4321 train_realesrgan.py -opt options/train_realesrgan_x4plus.yml
"""
import argparse
import logging
import math
import os
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.discriminator_arch import UNetDiscriminatorSN
from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.data.degradations import (random_add_gaussian_noise_pt, random_add_poisson_noise_pt)
from basicsr.data.realesrgan_dataset import RealESRGANDataset
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.losses.basic_loss import L1Loss, PerceptualLoss
from basicsr.losses.gan_loss import GANLoss
from basicsr.metrics import calculate_niqe, calculate_psnr
from basicsr.utils import DiffJPEG, USMSharp, tensor2img
from basicsr.utils.img_process_util import filter2D

logger = logging.getLogger('realesrgan')


def init_dist():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    return local_rank, dist.get_rank(), dist.get_world_size()


class Degrader:
    """GPU side of the Real-ESRGAN degradation model (first + second order)."""

    def __init__(self, opt, device):
        self.opt = opt
        self.device = device
        self.jpeger = DiffJPEG(differentiable=False).to(device)
        self.usm_sharpener = USMSharp().to(device)

    @torch.no_grad()
    def __call__(self, data):
        opt = self.opt
        gt = data['gt'].to(self.device)
        gt_usm = self.usm_sharpener(gt)
        kernel1 = data['kernel1'].to(self.device)
        kernel2 = data['kernel2'].to(self.device)
        sinc_kernel = data['sinc_kernel'].to(self.device)
        ori_h, ori_w = gt.size()[2:4]

        # ---- first degradation ----
        out = filter2D(gt_usm, kernel1)
        updown = random.choices(['up', 'down', 'keep'], opt['resize_prob'])[0]
        scale = {'up': np.random.uniform(1, opt['resize_range'][1]),
                 'down': np.random.uniform(opt['resize_range'][0], 1), 'keep': 1}[updown]
        out = F.interpolate(out, scale_factor=scale, mode=random.choice(['area', 'bilinear', 'bicubic']))
        if np.random.uniform() < opt['gaussian_noise_prob']:
            out = random_add_gaussian_noise_pt(out, sigma_range=opt['noise_range'], clip=True, rounds=False,
                                               gray_prob=opt['gray_noise_prob'])
        else:
            out = random_add_poisson_noise_pt(out, scale_range=opt['poisson_scale_range'],
                                              gray_prob=opt['gray_noise_prob'], clip=True, rounds=False)
        jpeg_p = out.new_zeros(out.size(0)).uniform_(*opt['jpeg_range'])
        out = self.jpeger(torch.clamp(out, 0, 1), quality=jpeg_p)

        # ---- second degradation ----
        if np.random.uniform() < opt['second_blur_prob']:
            out = filter2D(out, kernel2)
        updown = random.choices(['up', 'down', 'keep'], opt['resize_prob2'])[0]
        scale = {'up': np.random.uniform(1, opt['resize_range2'][1]),
                 'down': np.random.uniform(opt['resize_range2'][0], 1), 'keep': 1}[updown]
        out = F.interpolate(out, size=(int(ori_h / opt['scale'] * scale), int(ori_w / opt['scale'] * scale)),
                            mode=random.choice(['area', 'bilinear', 'bicubic']))
        if np.random.uniform() < opt['gaussian_noise_prob2']:
            out = random_add_gaussian_noise_pt(out, sigma_range=opt['noise_range2'], clip=True, rounds=False,
                                               gray_prob=opt['gray_noise_prob2'])
        else:
            out = random_add_poisson_noise_pt(out, scale_range=opt['poisson_scale_range2'],
                                              gray_prob=opt['gray_noise_prob2'], clip=True, rounds=False)
        out = F.interpolate(out, size=(ori_h // opt['scale'], ori_w // opt['scale']),
                            mode=random.choice(['area', 'bilinear', 'bicubic']))
        out = filter2D(out, sinc_kernel)
        jpeg_p = out.new_zeros(out.size(0)).uniform_(*opt['jpeg_range2'])
        out = self.jpeger(torch.clamp(out, 0, 1), quality=jpeg_p)

        lq = torch.clamp((out * 255.0).round(), 0, 255) / 255.
        # random crop of the aligned lq / gt pair
        gt_size = opt['gt_size']
        lq_size = gt_size // opt['scale']
        h, w = lq.shape[2:]
        top, left = random.randint(0, h - lq_size), random.randint(0, w - lq_size)
        lq = lq[:, :, top:top + lq_size, left:left + lq_size].contiguous()
        s = opt['scale']
        gt = gt[:, :, top * s:(top + lq_size) * s, left * s:(left + lq_size) * s].contiguous()
        gt_usm = gt_usm[:, :, top * s:(top + lq_size) * s, left * s:(left + lq_size) * s].contiguous()
        return lq, gt, gt_usm


@torch.no_grad()
def model_ema(net_g_ema, net_g, decay=0.999):
    net_g_params = dict(net_g.named_parameters())
    for k, v in net_g_ema.named_parameters():
        v.data.mul_(decay).add_(net_g_params[k].data, alpha=1 - decay)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('-opt', required=True)
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = yaml.safe_load(f)

    local_rank, rank, world_size = init_dist()
    device = torch.device('cuda', local_rank)
    # different degradations on every rank, same weights everywhere (DDP broadcasts them)
    seed = opt.get('manual_seed', 0) + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    exp_dir = os.path.join('experiments', opt['name'])
    if rank == 0:
        os.makedirs(os.path.join(exp_dir, 'models'), exist_ok=True)
        logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s',
                            handlers=[logging.FileHandler(os.path.join(exp_dir, 'train.log')),
                                      logging.StreamHandler()])
    dist.barrier()

    train_opt = opt['datasets']['train']
    train_set = RealESRGANDataset(train_opt)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(train_set, batch_size=train_opt['batch_size_per_gpu'], sampler=train_sampler,
                              num_workers=train_opt['num_worker_per_gpu'], pin_memory=True, drop_last=True)
    val_loader = None
    if rank == 0:
        val_loader = DataLoader(PairedImageDataset(opt['datasets']['val']), batch_size=1, num_workers=0)

    degrader = Degrader({**opt['degradation'], 'gt_size': train_opt['gt_size'], 'scale': opt['scale']}, device)

    net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=opt['scale'])
    ckpt = torch.load(opt['path']['pretrain_network_g'], map_location='cpu')
    net_g.load_state_dict(ckpt['params_ema'])
    net_g.to(device)
    net_g_ema = deepcopy(net_g).eval()
    net_d = UNetDiscriminatorSN(num_in_ch=3, num_feat=64, skip_connection=True).to(device)
    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])

    cri_pix = L1Loss(loss_weight=1.0).to(device)
    cri_perceptual = PerceptualLoss(layer_weights={'conv1_2': 0.1, 'conv2_2': 0.1, 'conv3_4': 1,
                                                   'conv4_4': 1, 'conv5_4': 1},
                                    vgg_type='vgg19', perceptual_weight=1.0, style_weight=0,
                                    range_norm=False, criterion='l1').to(device)
    cri_gan = GANLoss('vanilla', loss_weight=0.1).to(device)

    train_cfg = opt['train']
    opt_g = torch.optim.Adam(net_g.parameters(), lr=train_cfg['lr_g'], betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=train_cfg['lr_d'], betas=(0.9, 0.99))
    total_iter = train_cfg['total_iter']
    iters_per_epoch = len(train_loader)
    total_epochs = math.ceil(total_iter / iters_per_epoch)
    if rank == 0:
        logger.info(f'Training {total_iter} iters on {world_size} GPUs, '
                    f'{train_opt["batch_size_per_gpu"] * world_size} patches / iter')

    current_iter, tic = 0, time.time()
    for epoch in range(total_epochs + 1):
        train_sampler.set_epoch(epoch)
        for data in train_loader:
            current_iter += 1
            if current_iter > total_iter:
                break
            lq, gt, gt_usm = degrader(data)

            # -------- generator --------
            for p in net_d.parameters():
                p.requires_grad = False
            opt_g.zero_grad()
            output = net_g(lq)
            l_pix = cri_pix(output, gt_usm)
            l_percep, _ = cri_perceptual(output, gt_usm)
            fake_g_pred = net_d(output)
            l_gan = cri_gan(fake_g_pred, True, is_disc=False)
            (l_pix + l_percep + l_gan).backward()
            opt_g.step()

            # -------- discriminator: real and fake in separate backward passes --------
            for p in net_d.parameters():
                p.requires_grad = True
            opt_d.zero_grad()
            real_d_pred = net_d(gt)
            l_d_real = cri_gan(real_d_pred, True, is_disc=True)
            l_d_real.backward()
            fake_d_pred = net_d(output.detach().clone())
            l_d_fake = cri_gan(fake_d_pred, False, is_disc=True)
            l_d_fake.backward()
            opt_d.step()

            model_ema(net_g_ema, net_g.module, decay=0.999)

            if rank == 0 and current_iter % opt['logger']['print_freq'] == 0:
                logger.info(f'[ep {epoch} it {current_iter}] l_pix {l_pix.item():.4f} '
                            f'l_percep {l_percep.item():.4f} l_gan {l_gan.item():.4f} '
                            f'l_d_real {l_d_real.item():.4f} l_d_fake {l_d_fake.item():.4f} '
                            f'{(time.time() - tic) / current_iter:.3f}s/it')

            if current_iter % opt['logger']['save_checkpoint_freq'] == 0:
                if rank == 0:
                    torch.save({'params': net_g.module.state_dict(), 'params_ema': net_g_ema.state_dict()},
                               os.path.join(exp_dir, 'models', f'net_g_{current_iter}.pth'))
                    torch.save({'params': net_d.module.state_dict()},
                               os.path.join(exp_dir, 'models', f'net_d_{current_iter}.pth'))
                dist.barrier()

            if current_iter % opt['val']['val_freq'] == 0:
                if rank == 0:
                    psnr_sum, niqe_sum, n = 0.0, 0.0, 0
                    with torch.no_grad():
                        for vdata in val_loader:
                            sr_img = tensor2img(net_g_ema(vdata['lq'].to(device)))
                            gt_img = tensor2img(vdata['gt'])
                            psnr_sum += calculate_psnr(sr_img, gt_img, crop_border=4)
                            niqe_sum += calculate_niqe(sr_img, crop_border=4)
                            n += 1
                    logger.info(f'[val it {current_iter}] PSNR {psnr_sum / n:.3f} NIQE {niqe_sum / n:.3f}')
                dist.barrier()
        if current_iter > total_iter:
            break

    if rank == 0:
        torch.save({'params': net_g.module.state_dict(), 'params_ema': net_g_ema.state_dict()},
                   os.path.join(exp_dir, 'models', 'net_g_latest.pth'))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
