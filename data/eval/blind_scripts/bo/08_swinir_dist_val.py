"""SwinIR lightweight x4 with distributed full-image validation (Set5 + Set14 + Urban100).

Validation images are split round-robin over the ranks; each rank sums its
PSNR / SSIM and the sums are all-reduced, so every image counts exactly once.

    torchrun --nproc_per_node=8 train_swinir_light.py --cfg configs/swinir_light_x4.yaml
"""
import argparse
import logging
import os
import os.path as osp
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.swinir_arch import SwinIR
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.metrics import calculate_psnr, calculate_ssim
from basicsr.utils import tensor2img

log = logging.getLogger('swinir')


def setup():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    return local_rank, dist.get_rank(), dist.get_world_size()


def build_optimizer(net, cfg):
    skip = net.no_weight_decay() if hasattr(net, 'no_weight_decay') else set()
    skip_kw = net.no_weight_decay_keywords() if hasattr(net, 'no_weight_decay_keywords') else set()
    groups = {'decay': [], 'no_decay': []}
    for n, p in net.named_parameters():
        if p.ndim <= 1 or n in skip or any(k in n for k in skip_kw):
            groups['no_decay'].append(p)
        else:
            groups['decay'].append(p)
    return torch.optim.AdamW([{'params': groups['decay'], 'weight_decay': cfg['weight_decay']},
                              {'params': groups['no_decay'], 'weight_decay': 0.0}],
                             lr=cfg['lr'], betas=(0.9, 0.99))


@torch.no_grad()
def pad_and_run(net, lq, window_size, scale):
    _, _, h, w = lq.shape
    mod_pad_h = (window_size - h % window_size) % window_size
    mod_pad_w = (window_size - w % window_size) % window_size
    lq = F.pad(lq, (0, mod_pad_w, 0, mod_pad_h), 'reflect')
    return net(lq)[:, :, :h * scale, :w * scale]


@torch.no_grad()
def dist_validation(net, datasets, device, rank, world_size, scale):
    """net is the bare module. Returns {name: (psnr, ssim)} identical on all ranks."""
    net.eval()
    results = {}
    for name, ds in datasets.items():
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # psnr, ssim, count
        for idx in range(rank, len(ds), world_size):
            data = ds[idx]
            lq = data['lq'].unsqueeze(0).to(device)
            sr_img = tensor2img(pad_and_run(net, lq, net.window_size, scale))
            gt_img = tensor2img(data['gt'])
            sums[0] += calculate_psnr(sr_img, gt_img, crop_border=scale, test_y_channel=True)
            sums[1] += calculate_ssim(sr_img, gt_img, crop_border=scale, test_y_channel=True)
            sums[2] += 1
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        results[name] = ((sums[0] / sums[2]).item(), (sums[1] / sums[2]).item())
    net.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--cfg', required=True)
    ap.add_argument('--resume', default='')
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))
    local_rank, rank, world_size = setup()
    device = torch.device('cuda', local_rank)

    out_dir = osp.join('experiments', cfg['name'])
    if rank == 0:
        os.makedirs(osp.join(out_dir, 'models'), exist_ok=True)
        logging.basicConfig(level=logging.INFO, format='%(asctime)s | %(message)s',
                            handlers=[logging.StreamHandler(), logging.FileHandler(osp.join(out_dir, 'log.txt'))])
    random.seed(cfg['seed'] + rank)
    np.random.seed(cfg['seed'] + rank)
    torch.manual_seed(cfg['seed'])
    scale = cfg['scale']

    tr = dict(cfg['train_data'], phase='train', scale=scale)
    train_set = PairedImageDataset(tr)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg['seed'], drop_last=True)
    loader = DataLoader(train_set, batch_size=tr['batch_size_per_gpu'], sampler=sampler,
                        num_workers=tr['num_worker_per_gpu'], pin_memory=True, drop_last=True,
                        persistent_workers=True)
    val_sets = {name: PairedImageDataset(dict(v, phase='val', scale=scale))
                for name, v in cfg['val_data'].items()}

    net = SwinIR(upscale=scale, in_chans=3, img_size=64, window_size=8, img_range=1.,
                 depths=[6, 6, 6, 6], embed_dim=60, num_heads=[6, 6, 6, 6], mlp_ratio=2,
                 upsampler='pixelshuffledirect', resi_connection='1conv').to(device)
    optimizer = build_optimizer(net, cfg['optim'])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg['optim']['milestones'], gamma=0.5)
    start_iter = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location='cpu')
        net.load_state_dict(ckpt['params'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        start_iter = ckpt['iter']
    # weight-decay groups are built on the bare SwinIR (it owns no_weight_decay*), then wrapped
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)

    total_iter = cfg['optim']['total_iter']
    it = start_iter
    epoch = it // len(loader)
    best = {}
    if rank == 0:
        log.info(f'train {len(train_set)} imgs | val {[len(v) for v in val_sets.values()]} | '
                 f'{world_size} GPUs | start iter {it}')
    tic = time.time()
    while it < total_iter:
        sampler.set_epoch(epoch)
        for batch in loader:
            lq = batch['lq'].to(device, non_blocking=True)
            gt = batch['gt'].to(device, non_blocking=True)
            loss = F.l1_loss(model(lq), gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1

            if rank == 0 and it % cfg['print_freq'] == 0:
                log.info(f'it {it} ep {epoch} l1 {loss.item():.5f} lr {scheduler.get_last_lr()[0]:.2e} '
                         f'{(time.time() - tic) / (it - start_iter):.3f}s/it')

            if it % cfg['val_freq'] == 0:
                res = dist_validation(model.module, val_sets, device, rank, world_size, scale)
                if rank == 0:
                    for name, (p, s) in res.items():
                        tag = ''
                        if p > best.get(name, 0.0):
                            best[name] = p
                            tag = ' (best)'
                        log.info(f'[val it {it}] {name}: PSNR {p:.4f} SSIM {s:.4f}{tag}')

            if it % cfg['save_freq'] == 0 and rank == 0:
                torch.save({'params': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                            'scheduler': scheduler.state_dict(), 'iter': it},
                           osp.join(out_dir, 'models', f'swinir_{it}.pth'))
            if it >= total_iter:
                break
        epoch += 1

    if rank == 0:
        torch.save({'params': model.module.state_dict(), 'iter': it}, osp.join(out_dir, 'models', 'latest.pth'))
        log.info(f'done: best {best}')
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
