"""RCAN x4 on DIV2K. Full 2K images are slow to decode for 48x48 crops, so the
first run cuts them into overlapping 480x480 (GT) / 120x120 (LQ) sub-images and
caches them next to the dataset, as in BasicSR's extract_subimages.py.

    torchrun --nproc_per_node=4 train_rcan_div2k.py --root /data/DIV2K --scale 4
"""
import argparse
import glob
import logging
import os
import os.path as osp
import random
import time
from multiprocessing import Pool

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from basicsr.archs.rcan_arch import RCAN
from basicsr.metrics import calculate_psnr
from basicsr.utils import img2tensor, tensor2img


def crop_one(args):
    path, save_dir, crop, step, thresh = args
    name, ext = osp.splitext(osp.basename(path))
    img = cv2.imread(path, cv2.IMREAD_UNCHANGED)
    h, w = img.shape[:2]
    hs = np.arange(0, h - crop + 1, step)
    if h - (hs[-1] + crop) > thresh:
        hs = np.append(hs, h - crop)
    ws = np.arange(0, w - crop + 1, step)
    if w - (ws[-1] + crop) > thresh:
        ws = np.append(ws, w - crop)
    idx = 0
    for y in hs:
        for x in ws:
            idx += 1
            patch = np.ascontiguousarray(img[y:y + crop, x:x + crop, ...])
            cv2.imwrite(osp.join(save_dir, f'{name}_s{idx:03d}{ext}'), patch, [cv2.IMWRITE_PNG_COMPRESSION, 3])


def extract_subimages(src_dir, save_dir, crop, step, thresh, n_thread=16):
    os.makedirs(save_dir, exist_ok=True)
    jobs = [(p, save_dir, crop, step, thresh) for p in sorted(glob.glob(osp.join(src_dir, '*.png')))]
    with Pool(n_thread) as pool:
        pool.map(crop_one, jobs)


def prepare_subimages(root, scale):
    gt_sub = osp.join(root, 'DIV2K_train_HR_sub')
    lq_sub = osp.join(root, f'DIV2K_train_LR_bicubic_X{scale}_sub')
    if not osp.isdir(gt_sub) or not osp.isdir(lq_sub):
        extract_subimages(osp.join(root, 'DIV2K_train_HR'), gt_sub, 480, 240, 0)
        extract_subimages(osp.join(root, 'DIV2K_train_LR_bicubic', f'X{scale}'), lq_sub,
                          480 // scale, 240 // scale, 0)
        with open(osp.join(gt_sub, 'meta_info.txt'), 'w') as f:
            for p in sorted(glob.glob(osp.join(gt_sub, '*.png'))):
                f.write(osp.basename(p) + '\n')
    return gt_sub, lq_sub


class SubImageDataset(Dataset):
    def __init__(self, gt_dir, lq_dir, scale, gt_size):
        with open(osp.join(gt_dir, 'meta_info.txt')) as f:
            self.names = [line.strip() for line in f if line.strip()]
        self.gt_dir, self.lq_dir = gt_dir, lq_dir
        self.scale, self.gt_size = scale, gt_size

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        name = self.names[i]
        gt = cv2.imread(osp.join(self.gt_dir, name)).astype(np.float32) / 255.
        stem, ext = osp.splitext(name)
        base, sidx = stem.rsplit('_', 1)
        lq = cv2.imread(osp.join(self.lq_dir, f'{base}x{self.scale}_{sidx}{ext}')).astype(np.float32) / 255.
        ls = self.gt_size // self.scale
        y, x = random.randint(0, lq.shape[0] - ls), random.randint(0, lq.shape[1] - ls)
        lq = lq[y:y + ls, x:x + ls]
        gt = gt[y * self.scale:(y + ls) * self.scale, x * self.scale:(x + ls) * self.scale]
        if random.random() < 0.5:
            lq, gt = lq[:, ::-1], gt[:, ::-1]
        if random.random() < 0.5:
            lq, gt = lq[::-1], gt[::-1]
        if random.random() < 0.5:
            lq, gt = lq.transpose(1, 0, 2), gt.transpose(1, 0, 2)
        lq, gt = img2tensor([np.ascontiguousarray(lq), np.ascontiguousarray(gt)], bgr2rgb=True, float32=True)
        return lq, gt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--root', required=True)
    ap.add_argument('--val_root', default='/data/benchmark/Set5')
    ap.add_argument('--scale', type=int, default=4)
    ap.add_argument('--gt_size', type=int, default=192)
    ap.add_argument('--batch_size', type=int, default=16)
    ap.add_argument('--lr', type=float, default=1e-4)
    ap.add_argument('--total_iter', type=int, default=300000)
    ap.add_argument('--milestones', type=int, nargs='+', default=[200000])
    ap.add_argument('--save_dir', default='experiments/rcan_x4_div2k')
    args = ap.parse_args()

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    logger = logging.getLogger('rcan')
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format='%(asctime)s [%(levelname)s] %(message)s')
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100)

    logger.info('Checking sub-image cache ...')
    gt_sub, lq_sub = prepare_subimages(args.root, args.scale)
    train_set = SubImageDataset(gt_sub, lq_sub, args.scale, args.gt_size)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    logger.info(f'{len(train_set)} sub-images, {len(loader)} iterations per epoch on {world} GPUs')

    net = RCAN(num_in_ch=3, num_out_ch=3, num_feat=64, num_group=10, num_block=20, squeeze_factor=16,
               upscale=args.scale, res_scale=1, img_range=255., rgb_mean=[0.4488, 0.4371, 0.4040])
    net = DDP(net.to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(net.parameters(), lr=args.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, args.milestones, gamma=0.5)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    it, epoch, t0 = 0, 0, time.time()
    while it < args.total_iter:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            loss = F.l1_loss(net(lq), gt)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            it += 1
            if it % 200 == 0:
                logger.info(f'iter {it} epoch {epoch} l1 {loss.item():.5f} lr {sched.get_last_lr()[0]:.2e} '
                            f'{(time.time() - t0) / it:.3f}s/it')
            if it % 10000 == 0:
                if rank == 0:
                    torch.save(net.module.state_dict(), osp.join(args.save_dir, f'rcan_{it}.pth'))
                    model = net.module.eval()
                    psnr, names = 0.0, sorted(os.listdir(osp.join(args.val_root, 'HR')))
                    with torch.no_grad():
                        for n in names:
                            hr = cv2.imread(osp.join(args.val_root, 'HR', n))
                            lr = cv2.imread(osp.join(args.val_root, f'LR_bicubic/X{args.scale}',
                                                     n.replace('.png', f'x{args.scale}.png')))
                            inp = img2tensor(lr.astype(np.float32) / 255., bgr2rgb=True).unsqueeze(0).to(device)
                            sr = tensor2img(model(inp))
                            psnr += calculate_psnr(sr, hr[:sr.shape[0], :sr.shape[1]], args.scale,
                                                   test_y_channel=True)
                    model.train()
                    logger.info(f'[val {it}] Set5 PSNR-Y {psnr / len(names):.3f}')
                dist.barrier()
            if it >= args.total_iter:
                break
        epoch += 1

    if rank == 0:
        torch.save(net.module.state_dict(), osp.join(args.save_dir, 'rcan_final.pth'))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
