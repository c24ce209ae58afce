"""ESRGAN x4 GAN stage: RRDBNet generator + VGG-style discriminator.

Initialised from the PSNR-oriented RRDBNet checkpoint and trained with
L1 + perceptual + relativistic-average GAN loss, iteration based.

    torchrun --nproc_per_node=4 train_esrgan.py -opt options/train_ESRGAN_x4.yml
"""
import argparse
import logging
import math
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

from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.losses.basic_loss import L1Loss, PerceptualLoss
from basicsr.losses.gan_loss import GANLoss
from basicsr.metrics import calculate_psnr
from basicsr.utils import tensor2img

logger = logging.getLogger('esrgan')


class VGGStyleDiscriminator(nn.Module):
    """VGG style discriminator for 128x128 GT patches (as in the ESRGAN paper)."""

    def __init__(self, num_in_ch=3, num_feat=64):
        super().__init__()
        self.conv0_0 = nn.Conv2d(num_in_ch, num_feat, 3, 1, 1, bias=True)
        self.conv0_1 = nn.Conv2d(num_feat, num_feat, 4, 2, 1, bias=False)
        self.bn0_1 = nn.BatchNorm2d(num_feat, affine=True)
        chans = [num_feat, num_feat * 2, num_feat * 4, num_feat * 8, num_feat * 8]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [
                nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout, affine=True),
                nn.LeakyReLU(0.2, True),
                nn.Conv2d(cout, cout, 4, 2, 1, bias=False), nn.BatchNorm2d(cout, affine=True),
                nn.LeakyReLU(0.2, True)
            ]
        self.body = nn.Sequential(*layers)
        self.linear1 = nn.Linear(num_feat * 8 * 4 * 4, 100)
        self.linear2 = nn.Linear(100, 1)
        self.lrelu = nn.LeakyReLU(0.2, True)

    def forward(self, x):
        assert x.size(2) == 128 and x.size(3) == 128, f'Input should be 128x128, got {x.size()}'
        feat = self.lrelu(self.conv0_0(x))
        feat = self.lrelu(self.bn0_1(self.conv0_1(feat)))
        feat = self.body(feat)
        feat = feat.view(feat.size(0), -1)
        return self.linear2(self.lrelu(self.linear1(feat)))


@torch.no_grad()
def ema_update(net_ema, net, decay=0.999):
    ema_params = dict(net_ema.named_parameters())
    for k, v in net.named_parameters():
        ema_params[k].mul_(decay).add_(v.detach(), alpha=1 - decay)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def parse_options():
    parser = argparse.ArgumentParser()
    parser.add_argument('-opt', type=str, required=True, help='Path to option YAML file.')
    parser.add_argument('--auto_resume', action='store_true')
    args = parser.parse_args()
    with open(args.opt, 'r') as f:
        opt = yaml.safe_load(f)
    opt['auto_resume'] = args.auto_resume
    return opt


def validate(net, val_loader, device, scale, crop_border):
    net.eval()
    psnr_sum, n = 0.0, 0
    with torch.no_grad():
        for data in val_loader:
            lq = data['lq'].to(device)
            sr = net(lq)
            sr_img = tensor2img(sr)
            gt_img = tensor2img(data['gt'])
            psnr_sum += calculate_psnr(sr_img, gt_img, crop_border=crop_border, test_y_channel=True)
            n += 1
    net.train()
    return psnr_sum / max(n, 1)


def main():
    opt = parse_options()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    exp_dir = osp.join('experiments', opt['name'])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, 'models'), exist_ok=True)
        logging.basicConfig(filename=osp.join(exp_dir, 'train.log'), level=logging.INFO,
                            format='%(asctime)s %(levelname)s: %(message)s')
        logger.addHandler(logging.StreamHandler())
    else:
        logger.setLevel(logging.ERROR)
    set_seed(opt['manual_seed'] + rank)
    torch.backends.cudnn.benchmark = True

    # ---------------- data ----------------
    train_opt = opt['datasets']['train']
    train_opt['phase'] = 'train'
    train_opt['scale'] = opt['scale']
    train_set = PairedImageDataset(train_opt)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=train_opt['batch_size_per_gpu'], sampler=train_sampler,
                              num_workers=train_opt['num_worker_per_gpu'], pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_opt = opt['datasets']['val']
    val_opt['phase'] = 'val'
    val_opt['scale'] = opt['scale']
    val_loader = DataLoader(PairedImageDataset(val_opt), batch_size=1, shuffle=False, num_workers=1)

    # ---------------- networks ----------------
    net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=opt['scale'])
    pretrain = torch.load(opt['path']['pretrain_network_g'], map_location='cpu')
    net_g.load_state_dict(pretrain.get('params_ema', pretrain.get('params', pretrain)), strict=True)
    net_g = net_g.to(device)
    net_g_ema = deepcopy(net_g).eval()
    for p in net_g_ema.parameters():
        p.requires_grad_(False)

    net_d = VGGStyleDiscriminator(num_in_ch=3, num_feat=64).to(device)

    net_g = DDP(net_g, device_ids=[local_rank], output_device=local_rank)
    net_d = DDP(net_d, device_ids=[local_rank], output_device=local_rank)

    cri_pix = L1Loss(loss_weight=1e-2).to(device)
    cri_perceptual = PerceptualLoss(
        layer_weights={'conv5_4': 1}, vgg_type='vgg19', use_input_norm=True,
        perceptual_weight=1.0, style_weight=0, criterion='l1').to(device)
    cri_gan = GANLoss('vanilla', real_label_val=1.0, fake_label_val=0.0, loss_weight=5e-3).to(device)

    train_cfg = opt['train']
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=train_cfg['lr_g'], betas=(0.9, 0.99))
    optimizer_d = torch.optim.Adam(net_d.parameters(), lr=train_cfg['lr_d'], betas=(0.9, 0.99))
    sched_g = torch.optim.lr_scheduler.MultiStepLR(optimizer_g, train_cfg['milestones'], gamma=0.5)
    sched_d = torch.optim.lr_scheduler.MultiStepLR(optimizer_d, train_cfg['milestones'], gamma=0.5)

    total_iter = int(train_cfg['total_iter'])
    net_d_init_iters = train_cfg.get('net_d_init_iters', 0)
    iters_per_epoch = len(train_loader)
    total_epochs = math.ceil(total_iter / iters_per_epoch)
    logger.info(f'Train images: {len(train_set)}, world size: {world_size}, '
                f'iters/epoch: {iters_per_epoch}, total epochs: {total_epochs}, total iters: {total_iter}')

    current_iter = 0
    start_epoch = 0
    best_psnr = -1.0
    t0 = time.time()
    for epoch in range(start_epoch, total_epochs + 1):
        train_sampler.set_epoch(epoch)
        for data in train_loader:
            current_iter += 1
            if current_iter > total_iter:
                break
            lq = data['lq'].to(device, non_blocking=True)
            gt = data['gt'].to(device, non_blocking=True)

            # ---- optimize net_g ----
            for p in net_d.parameters():
                p.requires_grad = False
            optimizer_g.zero_grad(set_to_none=True)
            output = net_g(lq)
            l_g_total = 0
            log = {}
            if current_iter > net_d_init_iters:
                l_g_pix = cri_pix(output, gt)
                l_g_percep, _ = cri_perceptual(output, gt)
                real_d_pred = net_d(gt).detach()
                fake_g_pred = net_d(output)
                l_g_real = cri_gan(real_d_pred - torch.mean(fake_g_pred), False, is_disc=False)
                l_g_fake = cri_gan(fake_g_pred - torch.mean(real_d_pred), True, is_disc=False)
                l_g_gan = (l_g_real + l_g_fake) / 2
                l_g_total = l_g_pix + l_g_percep + l_g_gan
                l_g_total.backward()
                optimizer_g.step()
                log.update(l_g_pix=l_g_pix.item(), l_g_percep=l_g_percep.item(), l_g_gan=l_g_gan.item())

            # ---- optimize net_d ----
            for p in net_d.parameters():
                p.requires_grad = True
            optimizer_d.zero_grad(set_to_none=True)
            real_d_pred = net_d(gt)
            fake_d_pred = net_d(output.detach())
            l_d_real = cri_gan(real_d_pred - torch.mean(fake_d_pred), True, is_disc=True)
            l_d_fake = cri_gan(fake_d_pred - torch.mean(real_d_pred), False, is_disc=True)
            l_d_total = (l_d_real + l_d_fake) / 2
            l_d_total.backward()
            optimizer_d.step()
            log.update(l_d_real=l_d_real.item(), l_d_fake=l_d_fake.item(),
                       out_d_real=torch.mean(real_d_pred.detach()).item(),
                       out_d_fake=torch.mean(fake_d_pred.detach()).item())

            ema_update(net_g_ema, net_g.module, decay=train_cfg.get('ema_decay', 0.999))
            sched_g.step()
            sched_d.step()

            if current_iter % opt['logger']['print_freq'] == 0 and rank == 0:
                elapsed = time.time() - t0
                msg = ' '.join(f'{k}: {v:.4e}' for k, v in log.items())
                logger.info(f'[epoch {epoch:3d}, iter {current_iter:8d}, lr {sched_g.get_last_lr()[0]:.2e}, '
                            f'{elapsed / current_iter:.3f}s/it] {msg}')

            if current_iter % opt['logger']['save_checkpoint_freq'] == 0:
                if rank == 0:
                    torch.save({'params': net_g.module.state_dict(), 'params_ema': net_g_ema.state_dict()},
                               osp.join(exp_dir, 'models', f'net_g_{current_iter}.pth'))
                    torch.save({'params': net_d.module.state_dict()},
                               osp.join(exp_dir, 'models', f'net_d_{current_iter}.pth'))
                    torch.save({'iter': current_iter, 'epoch': epoch,
                                'optimizer_g': optimizer_g.state_dict(), 'optimizer_d': optimizer_d.state_dict(),
                                'sched_g': sched_g.state_dict(), 'sched_d': sched_d.state_dict()},
                               osp.join(exp_dir, 'models', f'{current_iter}.state'))
                dist.barrier()

            if current_iter % opt['val']['val_freq'] == 0:
                if rank == 0:
                    psnr = validate(net_g_ema, val_loader, device, opt['scale'], opt['val']['crop_border'])
                    logger.info(f'Validation @ {current_iter}: PSNR(Y) {psnr:.4f} dB')
                    if psnr > best_psnr:
                        best_psnr = psnr
                        torch.save({'params_ema': net_g_ema.state_dict()},
                                   osp.join(exp_dir, 'models', 'net_g_best.pth'))
                dist.barrier()
        if current_iter > total_iter:
            break

    if rank == 0:
        torch.save({'params': net_g.module.state_dict(), 'params_ema': net_g_ema.state_dict()},
                   osp.join(exp_dir, 'models', 'net_g_latest.pth'))
        logger.info(f'End of training. Best PSNR {best_psnr:.4f}. Time {(time.time() - t0) / 3600:.2f}h')
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
