"""EDSR baseline x2 on DIV2K (folder dataset), iteration-based training with a
prefetching loader and periodic full-image validation on Set5 / Set14.

    torchrun --nproc_per_node=4 train_edsr_x2.py --cfg configs/edsr_baseline_x2.yaml
"""
import argparse
import logging
import os
import os.path as osp
import queue as Queue
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from basicsr.archs.edsr_arch import EDSR
from basicsr.data.paired_image_dataset import PairedImageDataset
from basicsr.metrics import calculate_psnr, calculate_ssim
from basicsr.utils import tensor2img


class PrefetchGenerator(threading.Thread):
    """Run a DataLoader iterator in a background thread."""

    def __init__(self, generator, num_prefetch_queue):
        threading.Thread.__init__(self)
        self.queue = Queue.Queue(num_prefetch_queue)
        self.generator = generator
        self.daemon = True
        self.start()

    def run(self):
        for item in self.generator:
            self.queue.put(item)
        self.queue.put(None)

    def __next__(self):
        next_item = self.queue.get()
        if next_item is None:
            raise StopIteration
        return next_item

    def __iter__(self):
        return self


class PrefetchDataLoader(DataLoader):
    def __init__(self, num_prefetch_queue, **kwargs):
        self.num_prefetch_queue = num_prefetch_queue
        super().__init__(**kwargs)

    def __iter__(self):
        return PrefetchGenerator(super().__iter__(), self.num_prefetch_queue)


def setup_logger(path, rank):
    logger = logging.getLogger('edsr_x2')
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    if rank == 0:
        fmt = logging.Formatter('%(asctime)s %(levelname)s: %(message)s')
        for h in (logging.FileHandler(path), logging.StreamHandler()):
            h.setFormatter(fmt)
            logger.addHandler(h)
    return logger


@torch.no_grad()
def validate(net, loaders, device, scale):
    net.eval()
    results = {}
    for name, loader in loaders.items():
        psnr, ssim = [], []
        for data in loader:
            sr = tensor2img(net(data['lq'].to(device)))
            gt = tensor2img(data['gt'])
            psnr.append(calculate_psnr(sr, gt, crop_border=scale, test_y_channel=True))
            ssim.append(calculate_ssim(sr, gt, crop_border=scale, test_y_channel=True))
        results[name] = (float(np.mean(psnr)), float(np.mean(ssim)))
    net.train()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg', required=True)
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    exp_dir = osp.join('experiments', cfg['name'])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, 'models'), exist_ok=True)
    dist.barrier()
    logger = setup_logger(osp.join(exp_dir, 'train.log'), rank)
    torch.manual_seed(cfg['seed'])
    np.random.seed(cfg['seed'] + rank)
    torch.backends.cudnn.benchmark = True

    scale = cfg['scale']
    tcfg = dict(cfg['datasets']['train'], phase='train', scale=scale)
    train_set = PairedImageDataset(tcfg)
    train_loader = PrefetchDataLoader(num_prefetch_queue=tcfg.get('prefetch', 4), dataset=train_set,
                                      batch_size=tcfg['batch_size_per_gpu'], shuffle=True,
                                      num_workers=tcfg['num_worker_per_gpu'], pin_memory=True, drop_last=True)
    val_loaders = {}
    if rank == 0:
        for name, vcfg in cfg['datasets']['val'].items():
            val_loaders[name] = DataLoader(PairedImageDataset(dict(vcfg, phase='val', scale=scale)),
                                           batch_size=1, shuffle=False, num_workers=1)

    net = EDSR(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=16, upscale=scale, res_scale=1,
               img_range=255., rgb_mean=[0.4488, 0.4371, 0.4040]).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg['train']['lr'], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg['train']['milestones'], gamma=0.5)
    total_iter = cfg['train']['total_iter']
    logger.info(f'{len(train_set)} training pairs, {len(train_loader)} iters per pass, '
                f'{world_size} GPUs x {tcfg["batch_size_per_gpu"]}')

    current_iter, epoch = 0, 0
    best = {}
    t0 = time.time()
    while current_iter < total_iter:
        for data in train_loader:
            current_iter += 1
            lq = data['lq'].to(device, non_blocking=True)
            gt = data['gt'].to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.l1_loss(model(lq), gt)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if current_iter % cfg['logger']['print_freq'] == 0:
                logger.info(f'[ep {epoch:03d} it {current_iter:07d}] l1 {loss.item():.5f} '
                            f'lr {scheduler.get_last_lr()[0]:.2e} eta {(time.time() - t0) / current_iter * (total_iter - current_iter) / 3600:.1f}h')

            if current_iter % cfg['logger']['save_freq'] == 0:
                if rank == 0:
                    torch.save({'params': model.module.state_dict()},
                               osp.join(exp_dir, 'models', f'net_g_{current_iter}.pth'))
                    torch.save({'iter': current_iter, 'epoch': epoch, 'optimizer': optimizer.state_dict(),
                                'scheduler': scheduler.state_dict()},
                               osp.join(exp_dir, 'models', f'{current_iter}.state'))
                dist.barrier()

            if current_iter % cfg['val']['val_freq'] == 0:
                if rank == 0:
                    res = validate(model.module, val_loaders, device, scale)
                    for name, (p, s) in res.items():
                        if p > best.get(name, (0, 0))[0]:
                            best[name] = (p, current_iter)
                        logger.info(f'[val {name}] it {current_iter}: PSNR {p:.4f} SSIM {s:.4f} '
                                    f'(best {best[name][0]:.4f} @ {best[name][1]})')
                dist.barrier()

            if current_iter >= total_iter:
                break
        epoch += 1

    if rank == 0:
        torch.save({'params': model.module.state_dict()}, osp.join(exp_dir, 'models', 'net_g_latest.pth'))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
