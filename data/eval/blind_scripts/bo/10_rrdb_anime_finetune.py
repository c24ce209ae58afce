"""Fine-tune RRDBNet x4 on a domain dataset (anime / illustration frames), with EMA,
periodic training-state dumps and automatic resume from the latest state.

    torchrun --nproc_per_node=8 finetune_rrdb.py -opt options/finetune_rrdb_anime.yml --auto_resume
"""
import argparse
import logging
import math
import os
import os.path as osp
import random
import time
from collections import OrderedDict
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.losses.basic_loss import CharbonnierLoss
from basicsr.metrics import calculate_psnr
from basicsr.utils import get_root_logger, tensor2img


class SRModel:
    def __init__(self, opt, device):
        self.opt = opt
        self.device = device
        net = RRDBNet(3, 3, num_feat=64, num_block=23, num_grow_ch=32, scale=opt['scale'])
        load_path = opt['path'].get('pretrain_network_g')
        if load_path:
            state = torch.load(load_path, map_location=lambda storage, loc: storage)
            state = state.get('params_ema', state.get('params', state))
            state = OrderedDict((k[7:] if k.startswith('module.') else k, v) for k, v in state.items())
            net.load_state_dict(state, strict=True)
        net = net.to(device)
        self.net_g_ema = deepcopy(net).eval()
        for p in self.net_g_ema.parameters():
            p.requires_grad_(False)
        self.net_g = DDP(net, device_ids=[torch.cuda.current_device()], find_unused_parameters=False)

        tcfg = opt['train']
        self.cri_pix = CharbonnierLoss(loss_weight=1.0, eps=1e-6).to(device)
        self.optimizer_g = torch.optim.Adam(self.net_g.parameters(), lr=tcfg['lr'], betas=(0.9, 0.99))
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer_g, T_max=tcfg['total_iter'],
                                                                    eta_min=tcfg.get('eta_min', 1e-7))
        self.ema_decay = tcfg.get('ema_decay', 0.999)
        self.log_dict = {}

    def feed_data(self, data):
        self.lq = data['lq'].to(self.device, non_blocking=True)
        self.gt = data['gt'].to(self.device, non_blocking=True)

    def optimize_parameters(self):
        self.optimizer_g.zero_grad(set_to_none=True)
        self.output = self.net_g(self.lq)
        l_pix = self.cri_pix(self.output, self.gt)
        l_pix.backward()
        self.optimizer_g.step()
        self.scheduler.step()
        self.log_dict['l_pix'] = l_pix.item()
        with torch.no_grad():
            ema_p = dict(self.net_g_ema.named_parameters())
            for k, v in self.net_g.module.named_parameters():
                ema_p[k].mul_(self.ema_decay).add_(v, alpha=1 - self.ema_decay)

    def save(self, exp_dir, epoch, current_iter):
        torch.save({'params': self.net_g.module.state_dict(), 'params_ema': self.net_g_ema.state_dict()},
                   osp.join(exp_dir, 'models', f'net_g_{current_iter}.pth'))
        torch.save({'epoch': epoch, 'iter': current_iter, 'optimizers': [self.optimizer_g.state_dict()],
                    'schedulers': [self.scheduler.state_dict()]},
                   osp.join(exp_dir, 'training_states', f'{current_iter}.state'))

    def resume_training(self, resume_state, exp_dir):
        ckpt_path = osp.join(exp_dir, 'models', f"net_g_{resume_state['iter']}.pth")
        ckpt = torch.load(ckpt_path, map_location='cpu')
        self.net_g.module.load_state_dict(ckpt['params'])
        self.net_g_ema.load_state_dict(ckpt['params_ema'])
        self.optimizer_g.load_state_dict(resume_state['optimizers'][0])
        self.scheduler.load_state_dict(resume_state['schedulers'][0])

    @torch.no_grad()
    def validation(self, val_loader, crop_border):
        psnr, n = 0.0, 0
        for val_data in val_loader:
            sr = self.net_g_ema(val_data['lq'].to(self.device))
            psnr += calculate_psnr(tensor2img(sr), tensor2img(val_data['gt']), crop_border, test_y_channel=True)
            n += 1
        return psnr / max(n, 1)


def latest_state(state_dir):
    if not osp.isdir(state_dir):
        return None
    its = [int(f.split('.')[0]) for f in os.listdir(state_dir) if f.endswith('.state')]
    return osp.join(state_dir, f'{max(its)}.state') if its else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('-opt', required=True)
    parser.add_argument('--auto_resume', action='store_true')
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
        for sub in ('models', 'training_states'):
            os.makedirs(osp.join(exp_dir, sub), exist_ok=True)
    dist.barrier()
    logger = get_root_logger(logger_name='finetune', log_level=logging.INFO,
                             log_file=osp.join(exp_dir, 'train.log'))

    resume_state = None
    if args.auto_resume:
        state_path = latest_state(osp.join(exp_dir, 'training_states'))
        if state_path is not None:
            resume_state = torch.load(state_path)
            logger.info(f'Found training state {state_path}')

    seed = opt.get('manual_seed', 0)
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)

    train_opt = dict(opt['datasets']['train'], phase='train', scale=opt['scale'])
    train_set = PairedImageDataset(train_opt)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size=train_opt['batch_size_per_gpu'], sampler=sampler,
                              num_workers=train_opt['num_worker_per_gpu'], drop_last=True, pin_memory=True)
    val_loader = DataLoader(PairedImageDataset(dict(opt['datasets']['val'], phase='val', scale=opt['scale'])),
                            batch_size=1, shuffle=False, num_workers=0)

    model = SRModel(opt, device)
    start_epoch, current_iter = 0, 0
    if resume_state is not None:
        model.resume_training(resume_state, exp_dir)
        start_epoch, current_iter = resume_state['epoch'], resume_state['iter']
        logger.info(f'Resuming training from epoch {start_epoch}, iter {current_iter}')
        del resume_state
        torch.cuda.empty_cache()

    total_iter = opt['train']['total_iter']
    total_epochs = math.ceil(total_iter / len(train_loader))
    t0 = time.time()
    for epoch in range(start_epoch, total_epochs + 1):
        sampler.set_epoch(epoch)
        for data in train_loader:
            current_iter += 1
            if current_iter > total_iter:
                break
            model.feed_data(data)
            model.optimize_parameters()

            if current_iter % opt['logger']['print_freq'] == 0:
                logger.info(f'[ep {epoch} it {current_iter}] l_pix {model.log_dict["l_pix"]:.4e} '
                            f'lr {model.scheduler.get_last_lr()[0]:.3e} {time.time() - t0:.0f}s')
            if current_iter % opt['logger']['save_checkpoint_freq'] == 0:
                if rank == 0:
                    model.save(exp_dir, epoch, current_iter)
                dist.barrier()
            if current_iter % opt['val']['val_freq'] == 0:
                if rank == 0:
                    psnr = model.validation(val_loader, crop_border=opt['scale'])
                    logger.info(f'[val it {current_iter}] PSNR(EMA) {psnr:.4f}')
                dist.barrier()
        if current_iter > total_iter:
            break

    if rank == 0:
        torch.save({'params': model.net_g.module.state_dict(), 'params_ema': model.net_g_ema.state_dict()},
                   osp.join(exp_dir, 'models', 'net_g_latest.pth'))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
