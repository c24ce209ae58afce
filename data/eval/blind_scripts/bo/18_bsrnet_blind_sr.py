"""BSRNet x4 (PSNR stage of BSRGAN): RRDB generator trained on the BSRGAN random-shuffle
degradation model, applied on the CPU inside the DataLoader workers (KAIR layout).

    torchrun --nproc_per_node=8 main_train_bsrnet.py --opt options/train_bsrnet_x4.json
"""
import argparse
import glob
import json
import logging
import math
import os
import random
import time
from collections import OrderedDict

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Adam, lr_scheduler
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from models.network_rrdbnet import RRDBNet
from utils import utils_blindsr as blindsr
from utils import utils_image as util


class DatasetBlindSR(Dataset):
    def __init__(self, opt):
        self.sf = opt['scale']
        self.patch_size = opt['H_size']
        self.shuffle_prob = opt.get('shuffle_prob', 0.1)
        self.use_sharp = opt.get('use_sharp', False)
        self.lq_patchsize = self.patch_size // self.sf
        self.paths_H = sorted(glob.glob(os.path.join(opt['dataroot_H'], '*.png')))

    def __len__(self):
        return len(self.paths_H)

    def __getitem__(self, index):
        H_path = self.paths_H[index]
        img_H = util.imread_uint(H_path, 3)
        H, W = img_H.shape[:2]
        if H < self.lq_patchsize * self.sf or W < self.lq_patchsize * self.sf:
            img_H = cv2.resize(img_H, (max(W, self.patch_size), max(H, self.patch_size)), cv2.INTER_CUBIC)
        img_H = util.uint2single(img_H)
        if random.random() < self.shuffle_prob:
            img_L, img_H = blindsr.degradation_bsrgan(img_H, self.sf, lq_patchsize=self.lq_patchsize,
                                                      isp_model=None)
        else:
            img_L, img_H = blindsr.degradation_bsrgan_plus(img_H, self.sf, shuffle_prob=0.5,
                                                           use_sharp=self.use_sharp, lq_patchsize=self.lq_patchsize)
        mode = random.randint(0, 7)
        img_L, img_H = util.augment_img(img_L, mode=mode), util.augment_img(img_H, mode=mode)
        return {'L': util.single2tensor3(img_L), 'H': util.single2tensor3(img_H), 'H_path': H_path}


class ModelPlain:
    def __init__(self, opt, device):
        self.opt = opt
        self.device = device
        self.save_dir = opt['path']['models']
        net = RRDBNet(in_nc=3, out_nc=3, nf=64, nb=23, gc=32, sf=opt['scale']).to(device)
        self.netG = DistributedDataParallel(net, device_ids=[torch.cuda.current_device()])
        self.G_lossfn = nn.L1Loss().to(device)
        self.G_optimizer = Adam(self.netG.parameters(), lr=opt['train']['G_optimizer_lr'], weight_decay=0)
        self.G_scheduler = lr_scheduler.MultiStepLR(self.G_optimizer, opt['train']['G_scheduler_milestones'],
                                                    opt['train']['G_scheduler_gamma'])
        self.log_dict = OrderedDict()

    def load(self):
        path = self.opt['path'].get('pretrained_netG')
        if path:
            sd = torch.load(path, map_location='cpu')
            self.netG.module.load_state_dict(sd, strict=True)
        path = self.opt['path'].get('pretrained_optimizerG')
        if path:
            self.G_optimizer.load_state_dict(torch.load(path, map_location=lambda s, l: s.cuda(self.device)))

    def feed_data(self, data):
        self.L = data['L'].to(self.device)
        self.H = data['H'].to(self.device)

    def optimize_parameters(self):
        self.G_optimizer.zero_grad()
        self.E = self.netG(self.L)
        loss = self.G_lossfn(self.E, self.H)
        loss.backward()
        clip = self.opt['train'].get('G_optimizer_clipgrad', 0)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(self.netG.parameters(), max_norm=clip, norm_type=2)
        self.G_optimizer.step()
        self.G_scheduler.step()
        self.log_dict['G_loss'] = loss.item()

    def save(self, iter_label):
        sd = {k: v.cpu() for k, v in self.netG.module.state_dict().items()}
        torch.save(sd, os.path.join(self.save_dir, f'{iter_label}_G.pth'))
        torch.save(self.G_optimizer.state_dict(), os.path.join(self.save_dir, f'{iter_label}_optimizerG.pth'))

    @torch.no_grad()
    def test(self, img_L):
        self.netG.module.eval()
        out = self.netG.module(img_L)
        self.netG.module.train()
        return out


def find_last_checkpoint(save_dir, net_type='G'):
    files = glob.glob(os.path.join(save_dir, f'*_{net_type}.pth'))
    if not files:
        return 0, None
    steps = [int(os.path.basename(f).split('_')[0]) for f in files]
    step = max(steps)
    return step, os.path.join(save_dir, f'{step}_{net_type}.pth')


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--opt', type=str, required=True)
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = json.load(f)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    opt['path']['models'] = os.path.join(opt['path']['root'], opt['task'], 'models')
    if rank == 0:
        os.makedirs(opt['path']['models'], exist_ok=True)
    dist.barrier()

    init_iter_G, init_path_G = find_last_checkpoint(opt['path']['models'], 'G')
    opt['path']['pretrained_netG'] = init_path_G
    _, init_path_opt = find_last_checkpoint(opt['path']['models'], 'optimizerG')
    opt['path']['pretrained_optimizerG'] = init_path_opt
    current_step = init_iter_G

    logger = logging.getLogger('train')
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format='%(asctime)s.%(msecs)03d : %(message)s',
                            handlers=[logging.FileHandler(os.path.join(opt['path']['root'], opt['task'],
                                                                       'train.log')), logging.StreamHandler()])
    seed = opt['train'].get('manual_seed') or 2021
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)

    dopt = opt['datasets']['train']
    dopt['scale'] = opt['scale']
    train_set = DatasetBlindSR(dopt)
    train_sampler = DistributedSampler(train_set, shuffle=dopt['dataloader_shuffle'], drop_last=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size=dopt['dataloader_batch_size'] // world_size,
                              shuffle=False, num_workers=dopt['dataloader_num_workers'] // world_size,
                              drop_last=True, pin_memory=True, sampler=train_sampler)
    test_paths = sorted(glob.glob(os.path.join(opt['datasets']['test']['dataroot_H'], '*.png')))

    model = ModelPlain(opt, device)
    model.load()
    if rank == 0:
        logger.info(f'train images {len(train_set)}, iters/epoch {math.ceil(len(train_set) / dopt["dataloader_batch_size"])}')

    epoch = 0
    while current_step < opt['train']['total_iter']:
        train_sampler.set_epoch(epoch)
        for train_data in train_loader:
            current_step += 1
            model.feed_data(train_data)
            model.optimize_parameters()

            if current_step % opt['train']['checkpoint_print'] == 0 and rank == 0:
                logger.info(f'<epoch:{epoch:3d}, iter:{current_step:8,d}, lr:{model.G_scheduler.get_last_lr()[0]:.3e}> '
                            + ' '.join(f'{k}: {v:.3e}' for k, v in model.log_dict.items()))

            if current_step % opt['train']['checkpoint_save'] == 0:
                if rank == 0:
                    logger.info('Saving the model.')
                model.save(current_step)

            if current_step % opt['train']['checkpoint_test'] == 0:
                if rank == 0:
                    psnr_sum = 0.0
                    for p in test_paths:
                        img_H = util.imread_uint(p, 3)
                        img_H = util.modcrop(img_H, opt['scale'])
                        img_L = util.imresize_np(util.uint2single(img_H), 1 / opt['scale'], True)
                        E = model.test(util.single2tensor4(img_L).to(device))
                        psnr_sum += util.calculate_psnr(util.tensor2uint(E), img_H, border=opt['scale'])
                    logger.info(f'<epoch:{epoch:3d}, iter:{current_step:8,d}, '
                                f'Average PSNR : {psnr_sum / len(test_paths):<.2f}dB')
                dist.barrier()

            if current_step >= opt['train']['total_iter']:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
