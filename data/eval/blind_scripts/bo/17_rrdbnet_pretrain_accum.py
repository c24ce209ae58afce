"""RRDBNet x4 PSNR-oriented pre-training (ESRGAN stage 1) on DF2K+OST sub-images in LMDB.

Large GT patches (256) do not fit a batch of 16 per GPU, so each optimizer step
accumulates `accum_steps` micro-batches; gradients are all-reduced only on the
last micro-batch of a step.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        train_rrdb_psnr.py --cfg configs/rrdb_psnr_x4.yaml
"""
import argparse
import contextlib
import logging
import os
import os.path as osp
import random
import time
from copy import deepcopy

import cv2
import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.metrics import calculate_psnr
from basicsr.utils import img2tensor, tensor2img


class LMDBPairs(Dataset):
    def __init__(self, gt_path, lq_path, scale, gt_size):
        self.gt_path, self.lq_path, self.scale, self.gt_size = gt_path, lq_path, scale, gt_size
        with open(osp.join(gt_path, 'meta_info.txt')) as f:
            self.keys = [ln.split()[0].rsplit('.', 1)[0] for ln in f if ln.strip()]
        self.envs = None  # opened in the worker process on first access

    def __len__(self):
        return len(self.keys)

    def _get(self, env, key):
        with env.begin(write=False) as txn:
            buf = txn.get(key.encode('ascii'))
        return cv2.imdecode(np.frombuffer(buf, np.uint8), cv2.IMREAD_COLOR).astype(np.float32) / 255.

    def __getitem__(self, idx):
        if self.envs is None:
            self.envs = tuple(lmdb.open(p, readonly=True, lock=False, readahead=False, meminit=False)
                              for p in (self.gt_path, self.lq_path))
        key = self.keys[idx]
        gt, lq = self._get(self.envs[0], key), self._get(self.envs[1], key)
        ls = self.gt_size // self.scale
        y, x = random.randint(0, lq.shape[0] - ls), random.randint(0, lq.shape[1] - ls)
        lq = lq[y:y + ls, x:x + ls]
        gt = gt[y * self.scale:(y + ls) * self.scale, x * self.scale:(x + ls) * self.scale]
        if random.random() < 0.5:
            lq, gt = cv2.flip(lq, 1), cv2.flip(gt, 1)
        if random.random() < 0.5:
            lq, gt = cv2.rotate(lq, cv2.ROTATE_90_CLOCKWISE), cv2.rotate(gt, cv2.ROTATE_90_CLOCKWISE)
        return img2tensor([lq, gt], bgr2rgb=True, float32=True)


def seed_worker(worker_id):
    s = torch.initial_seed() % 2 ** 32
    np.random.seed(s)
    random.seed(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--cfg', required=True)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    # experiments/ lives on the shared filesystem (see cfg['exp_root'])
    exp_dir = osp.join(cfg['exp_root'], cfg['name'])
    ckpt_path = osp.join(exp_dir, 'last.pth')
    if rank == 0:
        os.makedirs(exp_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f'%(asctime)s [r{rank}] %(message)s')
    log = logging.getLogger(__name__)
    torch.manual_seed(cfg['seed'])

    d = cfg['data']
    train_set = LMDBPairs(d['gt_lmdb'], d['lq_lmdb'], cfg['scale'], d['gt_size'])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg['seed'])
    g = torch.Generator()
    g.manual_seed(cfg['seed'] + rank)
    loader = DataLoader(train_set, batch_size=d['micro_batch'], sampler=sampler, num_workers=d['workers'],
                        pin_memory=True, drop_last=True, worker_init_fn=seed_worker, generator=g,
                        persistent_workers=False)

    net = RRDBNet(3, 3, num_feat=64, num_block=23, num_grow_ch=32, scale=cfg['scale']).to(device)
    net_ema = deepcopy(net).eval().requires_grad_(False)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank, gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg['lr'], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg['milestones'], gamma=0.5)
    accum = cfg['accum_steps']

    step, epoch = 0, 0
    if osp.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location='cpu')
        model.module.load_state_dict(ckpt['params'])
        net_ema.load_state_dict(ckpt['params_ema'])
        optimizer.load_state_dict(ckpt['optimizer'])
        scheduler.load_state_dict(ckpt['scheduler'])
        step, epoch = ckpt['step'], ckpt['epoch']
        log.info(f'resumed from {ckpt_path} at step {step} (epoch {epoch})')
        del ckpt

    log.info(f'world {world_size} | micro-batch {d["micro_batch"]} x accum {accum} | '
             f'{len(train_set)} patches, {len(loader) // accum} steps/epoch')
    tic = time.time()
    while step < cfg['total_steps']:
        sampler.set_epoch(epoch)
        it = iter(loader)
        for _ in range(len(loader) // accum):
            optimizer.zero_grad(set_to_none=True)
            running = 0.0
            for micro in range(accum):
                lq, gt = next(it)
                lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
                sync = micro == accum - 1
                ctx = contextlib.nullcontext() if sync else model.no_sync()
                with ctx:
                    loss = F.l1_loss(model(lq), gt) / accum
                    loss.backward()
                running += loss.item()
            optimizer.step()
            scheduler.step()
            step += 1
            with torch.no_grad():
                for pe, p in zip(net_ema.parameters(), model.module.parameters()):
                    pe.mul_(cfg['ema_decay']).add_(p.detach(), alpha=1 - cfg['ema_decay'])

            if step % cfg['print_freq'] == 0:
                log.info(f'step {step} ep {epoch} l1 {running:.5f} lr {scheduler.get_last_lr()[0]:.2e} '
                         f'{(time.time() - tic) / cfg["print_freq"]:.2f}s/step')
                tic = time.time()

            if step % cfg['save_freq'] == 0:
                if rank == 0:
                    tmp = ckpt_path + '.tmp'
                    torch.save({'params': model.module.state_dict(), 'params_ema': net_ema.state_dict(),
                                'optimizer': optimizer.state_dict(), 'scheduler': scheduler.state_dict(),
                                'step': step, 'epoch': epoch}, tmp)
                    os.replace(tmp, ckpt_path)
                    psnr, names = 0.0, sorted(os.listdir(osp.join(cfg['val_root'], 'HR')))
                    with torch.no_grad():
                        for n in names:
                            hr = cv2.imread(osp.join(cfg['val_root'], 'HR', n))
                            lr = cv2.imread(osp.join(cfg['val_root'], 'LR_bicubic/X4', n.replace('.png', 'x4.png')))
                            lr = img2tensor(lr.astype(np.float32) / 255., bgr2rgb=True).unsqueeze(0)
                            sr = tensor2img(net_ema(lr.to(device)))
                            psnr += calculate_psnr(sr, hr[:sr.shape[0], :sr.shape[1]], 4, test_y_channel=True)
                    log.info(f'[step {step}] Set5 PSNR-Y (EMA) {psnr / len(names):.3f}')
                dist.barrier()
            if step >= cfg['total_steps']:
                break
        epoch += 1

    if rank == 0:
        torch.save({'params': model.module.state_dict(), 'params_ema': net_ema.state_dict()},
                   osp.join(exp_dir, 'net_g_final.pth'))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
