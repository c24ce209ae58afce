"""SRVGGNetCompact (realesr-animevideo style) x4 GAN fine-tuning on offline-degraded pairs,
logged to Weights & Biases.

    torchrun --nproc_per_node=4 train_compact_gan.py --config configs/compact_gan_anime.yaml
"""
import argparse
import os
import os.path as osp
import random
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.discriminator_arch import UNetDiscriminatorSN
from basicsr.archs.srvgg_arch import SRVGGNetCompact
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.losses.basic_loss import L1Loss, PerceptualLoss
from basicsr.losses.gan_loss import GANLoss
from basicsr.metrics import calculate_psnr
from basicsr.utils import tensor2img


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument('--config', required=True)
    parser.add_argument('--run_name', default=None)
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg['run_name'] = args.run_name or cfg['name']
    return cfg


@torch.no_grad()
def update_ema(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm, 1.0 - decay)


def main():
    cfg = load_config()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    run = wandb.init(project=cfg['wandb']['project'], entity=cfg['wandb'].get('entity'),
                     name=cfg['run_name'], config=cfg, resume='allow')

    exp_dir = osp.join('experiments', cfg['name'])
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
    random.seed(cfg['seed'] + rank)
    np.random.seed(cfg['seed'] + rank)
    torch.manual_seed(cfg['seed'])

    tr = dict(cfg['datasets']['train'], phase='train', scale=cfg['scale'])
    train_set = PairedImageDataset(tr)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=tr['batch_size_per_gpu'], sampler=sampler,
                        num_workers=tr['num_worker_per_gpu'], pin_memory=True, drop_last=True)
    val_set = PairedImageDataset(dict(cfg['datasets']['val'], phase='val', scale=cfg['scale']))

    net_g = SRVGGNetCompact(num_in_ch=3, num_out_ch=3, num_feat=64, num_conv=16, upscale=cfg['scale'],
                            act_type='prelu')
    ckpt = torch.load(cfg['pretrain_g'], map_location='cpu')
    net_g.load_state_dict(ckpt['params'])
    net_g.to(device)
    net_g_ema = deepcopy(net_g).eval().requires_grad_(False)
    net_d = UNetDiscriminatorSN(3, num_feat=64, skip_connection=True).to(device)
    if cfg.get('pretrain_d'):
        net_d.load_state_dict(torch.load(cfg['pretrain_d'], map_location='cpu')['params'])
    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])

    cri_pix = L1Loss(loss_weight=1.0).to(device)
    cri_percep = PerceptualLoss({'conv1_2': 0.1, 'conv2_2': 0.1, 'conv3_4': 1, 'conv4_4': 1, 'conv5_4': 1},
                                vgg_type='vgg19', range_norm=False, perceptual_weight=1.0,
                                style_weight=0., criterion='l1').to(device)
    cri_gan = GANLoss('vanilla', loss_weight=0.1).to(device)
    opt_g = torch.optim.Adam(net_g.parameters(), lr=cfg['lr_g'], betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=cfg['lr_d'], betas=(0.9, 0.99))

    total_iter = cfg['total_iter']
    it, epoch, tic = 0, 0, time.time()
    while it < total_iter:
        sampler.set_epoch(epoch)
        for data in loader:
            it += 1
            lq = data['lq'].to(device, non_blocking=True)
            gt = data['gt'].to(device, non_blocking=True)

            # generator
            net_d.requires_grad_(False)
            opt_g.zero_grad(set_to_none=True)
            out = net_g(lq)
            l_pix = cri_pix(out, gt)
            l_percep, _ = cri_percep(out, gt)
            l_gan = cri_gan(net_d(out), True, is_disc=False)
            (l_pix + l_percep + l_gan).backward()
            opt_g.step()

            # discriminator
            net_d.requires_grad_(True)
            opt_d.zero_grad(set_to_none=True)
            real_pred = net_d(gt)
            l_d_real = cri_gan(real_pred, True, is_disc=True)
            l_d_real.backward()
            fake_pred = net_d(out.detach())
            l_d_fake = cri_gan(fake_pred, False, is_disc=True)
            l_d_fake.backward()
            opt_d.step()

            update_ema(net_g_ema, net_g.module, cfg.get('ema_decay', 0.999))

            if rank == 0 and it % cfg['log_every'] == 0:
                wandb.log({'train/l_pix': l_pix.item(), 'train/l_percep': l_percep.item(),
                           'train/l_g_gan': l_gan.item(), 'train/l_d_real': l_d_real.item(),
                           'train/l_d_fake': l_d_fake.item(), 'train/d_real': real_pred.mean().item(),
                           'train/d_fake': fake_pred.mean().item(),
                           'time/iter_s': (time.time() - tic) / cfg['log_every']}, step=it)
                tic = time.time()

            if it % cfg['val_every'] == 0:
                if rank == 0:
                    psnrs, samples = [], []
                    with torch.no_grad():
                        for i in range(len(val_set)):
                            d = val_set[i]
                            sr = tensor2img(net_g_ema(d['lq'].unsqueeze(0).to(device)))
                            gt_img = tensor2img(d['gt'])
                            psnrs.append(calculate_psnr(sr, gt_img, crop_border=cfg['scale']))
                            if i < 4:
                                samples.append(wandb.Image(sr[..., ::-1], caption=osp.basename(d['gt_path'])))
                    wandb.log({'val/psnr': float(np.mean(psnrs)), 'val/samples': samples}, step=it)
                    torch.save({'params': net_g.module.state_dict(), 'params_ema': net_g_ema.state_dict()},
                               osp.join(exp_dir, f'net_g_{it}.pth'))
                    torch.save({'params': net_d.module.state_dict()}, osp.join(exp_dir, f'net_d_{it}.pth'))
                dist.barrier()
            if it >= total_iter:
                break
        epoch += 1

    if rank == 0:
        torch.save({'params_ema': net_g_ema.state_dict()}, osp.join(exp_dir, 'net_g_final.pth'))
    run.finish()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
