"""MSRResNet (SRResNet without BN) x4, PSNR-oriented, DIV2K sub-images.

Usage:
    torchrun --nproc_per_node=4 --master_port=4321 train_msrresnet.py \
        -opt options/train/SRResNet_SRGAN/train_MSRResNet_x4.yml --launcher pytorch
"""
import argparse
import datetime
import logging
import math
import os
import os.path as osp
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.srresnet_arch import MSRResNet
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.losses.basic_loss import L1Loss
from basicsr.metrics import calculate_psnr
from basicsr.utils import get_root_logger, get_time_str, tensor2img
from basicsr.utils.options import ordered_yaml


def parse_options():
    parser = argparse.ArgumentParser()
    parser.add_argument('-opt', type=str, required=True, help='Path to option YAML file.')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm'], default='none', help='job launcher')
    parser.add_argument('--local_rank', type=int, default=0)
    parser.add_argument('--auto_resume', action='store_true')
    args = parser.parse_args()
    with open(args.opt, mode='r') as f:
        opt = yaml.load(f, Loader=ordered_yaml()[0])

    if args.launcher == 'none':
        opt['dist'] = False
        opt['rank'], opt['world_size'] = 0, 1
    else:
        opt['dist'] = True
        torch.cuda.set_device(args.local_rank)
        dist.init_process_group(backend='nccl')
        opt['rank'], opt['world_size'] = dist.get_rank(), dist.get_world_size()
    opt['local_rank'] = args.local_rank
    opt['auto_resume'] = args.auto_resume
    return opt


def set_random_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def find_latest_state(state_dir):
    if not osp.isdir(state_dir):
        return None
    states = [f for f in os.listdir(state_dir) if f.endswith('.state')]
    if not states:
        return None
    return osp.join(state_dir, f'{max(int(s.split(".")[0]) for s in states)}.state')


def main():
    opt = parse_options()
    rank, world_size = opt['rank'], opt['world_size']
    device = torch.device('cuda', opt['local_rank'])
    exp_root = osp.join('experiments', opt['name'])
    if rank == 0:
        os.makedirs(osp.join(exp_root, 'models'), exist_ok=True)
        os.makedirs(osp.join(exp_root, 'training_states'), exist_ok=True)
    if opt['dist']:
        dist.barrier()
    log_file = osp.join(exp_root, f"train_{opt['name']}_{get_time_str()}.log")
    logger = get_root_logger(logger_name='basicsr', log_level=logging.INFO, log_file=log_file)

    seed = opt.get('manual_seed') or random.randint(1, 10000)
    set_random_seed(seed + rank)
    torch.backends.cudnn.benchmark = True

    # ------------------------------------------------ dataloaders
    dataset_opt = opt['datasets']['train']
    dataset_opt.update(phase='train', scale=opt['scale'])
    train_set = PairedImageDataset(dataset_opt)
    train_sampler = DistributedSampler(train_set, world_size, rank) if opt['dist'] else None
    train_loader = DataLoader(train_set, batch_size=dataset_opt['batch_size_per_gpu'],
                              shuffle=train_sampler is None, sampler=train_sampler,
                              num_workers=dataset_opt['num_worker_per_gpu'], drop_last=True, pin_memory=True)
    val_opt = opt['datasets']['val']
    val_opt.update(phase='val', scale=opt['scale'])
    val_loader = DataLoader(PairedImageDataset(val_opt), batch_size=1, shuffle=False, num_workers=0)

    num_iter_per_epoch = len(train_loader)
    total_iters = int(opt['train']['total_iter'])
    total_epochs = math.ceil(total_iters / num_iter_per_epoch)
    logger.info(f'Training statistics: images {len(train_set)}, batch/gpu {dataset_opt["batch_size_per_gpu"]}, '
                f'world size {world_size}, iters/epoch {num_iter_per_epoch}, epochs {total_epochs}')

    # ------------------------------------------------ model
    net_g = MSRResNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=16, upscale=opt['scale']).to(device)
    if opt['dist']:
        net_g = DistributedDataParallel(net_g, device_ids=[opt['local_rank']])
    bare_g = net_g.module if opt['dist'] else net_g
    cri_pix = L1Loss(loss_weight=1.0, reduction='mean').to(device)
    train_opt = opt['train']
    optimizer_g = torch.optim.Adam(net_g.parameters(), lr=train_opt['optim_g']['lr'],
                                   weight_decay=0, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        optimizer_g, T_0=train_opt['scheduler']['period'], eta_min=train_opt['scheduler']['eta_min'])

    start_epoch, current_iter = 0, 0
    state_path = find_latest_state(osp.join(exp_root, 'training_states')) if opt['auto_resume'] else None
    if state_path is not None:
        state = torch.load(state_path, map_location=lambda storage, loc: storage.cuda(opt['local_rank']))
        bare_g.load_state_dict(torch.load(osp.join(exp_root, 'models', f"net_g_{state['iter']}.pth"),
                                          map_location='cpu')['params'])
        optimizer_g.load_state_dict(state['optimizers'][0])
        scheduler.load_state_dict(state['schedulers'][0])
        start_epoch, current_iter = state['epoch'], state['iter']
        logger.info(f'Resuming training from epoch: {start_epoch}, iter: {current_iter}.')

    # ------------------------------------------------ training
    logger.info(f'Start training from epoch: {start_epoch}, iter: {current_iter}')
    start_time = time.time()
    for epoch in range(start_epoch, total_epochs + 1):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        for train_data in train_loader:
            current_iter += 1
            if current_iter > total_iters:
                break
            lq = train_data['lq'].to(device)
            gt = train_data['gt'].to(device)
            optimizer_g.zero_grad()
            output = net_g(lq)
            l_pix = cri_pix(output, gt)
            l_pix.backward()
            optimizer_g.step()
            scheduler.step()

            if current_iter % opt['logger']['print_freq'] == 0:
                logger.info(f'[epoch:{epoch:3d}, iter:{current_iter:8,d}, lr:({scheduler.get_last_lr()[0]:.3e})] '
                            f'l_pix: {l_pix.item():.4e}')

            if current_iter % opt['logger']['save_checkpoint_freq'] == 0 and rank == 0:
                logger.info('Saving models and training states.')
                torch.save({'params': bare_g.state_dict()},
                           osp.join(exp_root, 'models', f'net_g_{current_iter}.pth'))
                torch.save({'epoch': epoch, 'iter': current_iter, 'optimizers': [optimizer_g.state_dict()],
                            'schedulers': [scheduler.state_dict()]},
                           osp.join(exp_root, 'training_states', f'{current_iter}.state'))

            if opt.get('val') is not None and current_iter % opt['val']['val_freq'] == 0:
                if rank == 0:
                    bare_g.eval()
                    psnr = 0.0
                    with torch.no_grad():
                        for val_data in val_loader:
                            sr_img = tensor2img(bare_g(val_data['lq'].to(device)))
                            gt_img = tensor2img(val_data['gt'])
                            psnr += calculate_psnr(sr_img, gt_img, crop_border=opt['scale'], test_y_channel=True)
                    bare_g.train()
                    logger.info(f'Validation {opt["name"]} # psnr: {psnr / len(val_loader):.4f}')
                if opt['dist']:
                    dist.barrier()
        if current_iter > total_iters:
            break

    consumed_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    logger.info(f'End of training. Time consumed: {consumed_time}')
    if rank == 0:
        torch.save({'params': bare_g.state_dict()}, osp.join(exp_root, 'models', 'net_g_latest.pth'))
    if opt['dist']:
        dist.destroy_process_group()


if __name__ == '__main__':
    main()
