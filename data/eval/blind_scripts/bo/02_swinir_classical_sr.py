# Classical image SR with SwinIR (DIV2K, x2/x3/x4), L1 loss, iteration based.
#   torchrun --nproc_per_node=8 train_swinir_sr.py --scale 4 --dataroot datasets/DIV2K
import argparse
import glob
import logging
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from basicsr.archs.swinir_arch import SwinIR
from basicsr.metrics.psnr_ssim import calculate_psnr, calculate_ssim


def get_args():
    p = argparse.ArgumentParser('SwinIR classical SR')
    p.add_argument('--dataroot', default='datasets/DIV2K')
    p.add_argument('--val_root', default='datasets/Set5')
    p.add_argument('--scale', type=int, default=4)
    p.add_argument('--patch_size', type=int, default=48, help='LR patch size')
    p.add_argument('--batch_size', type=int, default=4, help='per GPU')
    p.add_argument('--workers', type=int, default=8)
    p.add_argument('--lr', type=float, default=2e-4)
    p.add_argument('--weight_decay', type=float, default=0.0)
    p.add_argument('--total_iter', type=int, default=500000)
    p.add_argument('--milestones', type=int, nargs='+', default=[250000, 400000, 450000, 475000])
    p.add_argument('--val_freq', type=int, default=5000)
    p.add_argument('--save_freq', type=int, default=5000)
    p.add_argument('--print_freq', type=int, default=200)
    p.add_argument('--out_dir', default='experiments/swinir_sr')
    p.add_argument('--seed', type=int, default=10)
    return p.parse_args()


class DIV2KPatches(Dataset):
    """Paired DIV2K HR / bicubic LR images, random aligned crops + flips/rotations."""

    def __init__(self, root, scale, patch_size):
        self.hr_paths = sorted(glob.glob(os.path.join(root, 'DIV2K_train_HR', '*.png')))
        self.lr_dir = os.path.join(root, 'DIV2K_train_LR_bicubic', f'X{scale}')
        self.scale = scale
        self.patch = patch_size

    def __len__(self):
        return len(self.hr_paths)

    def __getitem__(self, idx):
        hr_path = self.hr_paths[idx]
        name = os.path.splitext(os.path.basename(hr_path))[0]
        hr = cv2.imread(hr_path, cv2.IMREAD_COLOR).astype(np.float32) / 255.
        lr = cv2.imread(os.path.join(self.lr_dir, f'{name}x{self.scale}.png'), cv2.IMREAD_COLOR)
        lr = lr.astype(np.float32) / 255.
        h, w = lr.shape[:2]
        top, left = random.randint(0, h - self.patch), random.randint(0, w - self.patch)
        lr = lr[top:top + self.patch, left:left + self.patch]
        s = self.scale
        hr = hr[top * s:(top + self.patch) * s, left * s:(left + self.patch) * s]
        if random.random() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        if random.random() < 0.5:
            lr, hr = lr[::-1], hr[::-1]
        if random.random() < 0.5:
            lr, hr = lr.transpose(1, 0, 2), hr.transpose(1, 0, 2)
        lr = torch.from_numpy(np.ascontiguousarray(lr[:, :, ::-1].transpose(2, 0, 1)))
        hr = torch.from_numpy(np.ascontiguousarray(hr[:, :, ::-1].transpose(2, 0, 1)))
        return lr, hr


def load_val_pairs(root, scale):
    pairs = []
    for hr_path in sorted(glob.glob(os.path.join(root, 'HR', '*.png'))):
        name = os.path.basename(hr_path)
        lr_path = os.path.join(root, f'LR_bicubic/X{scale}', name.replace('.png', f'x{scale}.png'))
        pairs.append((name, lr_path, hr_path))
    return pairs


def to_tensor(img):
    img = img.astype(np.float32) / 255.
    return torch.from_numpy(np.ascontiguousarray(img[:, :, ::-1].transpose(2, 0, 1))).unsqueeze(0)


def to_uint8(t):
    img = t.squeeze(0).float().clamp_(0, 1).cpu().numpy()
    return (img[::-1].transpose(1, 2, 0) * 255.0).round().astype(np.uint8)


@torch.no_grad()
def test_with_padding(model, lq, window_size, scale):
    # pad to a multiple of the window size (reflection), run, then crop back
    _, _, h, w = lq.size()
    ph = (h // window_size + 1) * window_size - h
    pw = (w // window_size + 1) * window_size - w
    lq = torch.cat([lq, torch.flip(lq, [2])], 2)[:, :, :h + ph, :]
    lq = torch.cat([lq, torch.flip(lq, [3])], 3)[:, :, :, :w + pw]
    out = model(lq)
    return out[..., :h * scale, :w * scale]


def main():
    args = get_args()
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f'cuda:{local_rank}')

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    is_main = rank == 0
    writer = None
    if is_main:
        os.makedirs(os.path.join(args.out_dir, 'models'), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out_dir, 'tb'))
        logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    log = logging.getLogger(__name__)

    model = SwinIR(upscale=args.scale, in_chans=3, img_size=args.patch_size, window_size=8,
                   img_range=1., depths=[6, 6, 6, 6, 6, 6], embed_dim=180,
                   num_heads=[6, 6, 6, 6, 6, 6], mlp_ratio=2, upsampler='pixelshuffle',
                   resi_connection='1conv').to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    # no weight decay on relative position tables / absolute embeddings, as in the Swin recipe
    skip = model.no_weight_decay()
    skip_keywords = model.no_weight_decay_keywords()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim == 1 or name in skip or any(k in name for k in skip_keywords):
            no_decay.append(param)
        else:
            decay.append(param)
    optimizer = torch.optim.Adam([{'params': decay, 'weight_decay': args.weight_decay},
                                  {'params': no_decay, 'weight_decay': 0.}], lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=0.5)

    train_set = DIV2KPatches(args.dataroot, args.scale, args.patch_size)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_pairs = load_val_pairs(args.val_root, args.scale)
    if is_main:
        log.info(f'{len(train_set)} training images, {len(val_pairs)} validation images, world size {world_size}')

    it, epoch = 0, 0
    t_start = time.time()
    while it < args.total_iter:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            it += 1
            lq = lq.to(device, non_blocking=True)
            gt = gt.to(device, non_blocking=True)
            sr = model(lq)
            loss = F.l1_loss(sr, gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if is_main and it % args.print_freq == 0:
                log.info(f'ep {epoch} it {it} loss {loss.item():.5f} lr {scheduler.get_last_lr()[0]:.2e} '
                         f'{(time.time() - t_start) / it:.3f}s/it')
                writer.add_scalar('train/l1', loss.item(), it)

            if it % args.val_freq == 0:
                if is_main:
                    net = model.module
                    net.eval()
                    psnrs, ssims = [], []
                    for name, lr_path, hr_path in val_pairs:
                        lq_img = to_tensor(cv2.imread(lr_path, cv2.IMREAD_COLOR)).to(device)
                        out = test_with_padding(net, lq_img, net.window_size, args.scale)
                        sr_img = to_uint8(out)
                        hr_img = cv2.imread(hr_path, cv2.IMREAD_COLOR)
                        hr_img = hr_img[:sr_img.shape[0], :sr_img.shape[1]]
                        psnrs.append(calculate_psnr(sr_img, hr_img, crop_border=args.scale, test_y_channel=True))
                        ssims.append(calculate_ssim(sr_img, hr_img, crop_border=args.scale, test_y_channel=True))
                    net.train()
                    log.info(f'[val it {it}] PSNR {np.mean(psnrs):.4f} SSIM {np.mean(ssims):.4f}')
                    writer.add_scalar('val/psnr', float(np.mean(psnrs)), it)
                    writer.add_scalar('val/ssim', float(np.mean(ssims)), it)
                dist.barrier()

            if it % args.save_freq == 0:
                if is_main:
                    torch.save(model.module.state_dict(), os.path.join(args.out_dir, 'models', f'{it}_G.pth'))
                    torch.save({'iter': it, 'epoch': epoch, 'optimizer': optimizer.state_dict(),
                                'scheduler': scheduler.state_dict()},
                               os.path.join(args.out_dir, 'models', f'{it}.state'))
                dist.barrier()

            if it >= args.total_iter:
                break
        epoch += 1

    if is_main:
        torch.save(model.module.state_dict(), os.path.join(args.out_dir, 'models', 'latest_G.pth'))
        writer.close()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
