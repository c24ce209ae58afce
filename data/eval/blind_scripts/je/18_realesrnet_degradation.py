"""Real-ESRNet x4: RRDBNet trained with L1 on synthetic blind degradations
(random blur kernel -> random resize -> Gaussian/Poisson noise -> JPEG), made on the GPU per batch.

    torchrun --nproc_per_node=8 18_realesrnet_degradation.py --gt_dir /data/DF2K_OST/multiscale_sub \
        --init weights/ESRGAN_SRx4_DF2KOST_official.pth --out experiments/realesrnet_x4
"""
import argparse
import copy
import math
import os
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.data.degradations import (circular_lowpass_kernel, random_add_gaussian_noise_pt,
                                       random_add_poisson_noise_pt, random_mixed_kernels)
from basicsr.utils import DiffJPEG
from basicsr.utils.img_process_util import filter2D
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

KERNEL_LIST = ["iso", "aniso", "generalized_iso", "generalized_aniso", "plateau_iso", "plateau_aniso"]
KERNEL_PROB = [0.45, 0.25, 0.12, 0.03, 0.12, 0.03]


class GTWithKernel(Dataset):
    """GT crop + a random blur kernel; the rest of the degradation runs on the GPU."""

    def __init__(self, gt_dir, gt_size=256, kernel_size=21):
        self.files = sorted(glob(os.path.join(gt_dir, "*.png")))
        self.gt_size, self.ks = gt_size, kernel_size

    def __len__(self):
        return len(self.files)

    def _kernel(self):
        if random.random() < 0.1:
            k = circular_lowpass_kernel(random.uniform(np.pi / 3, np.pi), self.ks, pad_to=False)
        else:
            k = random_mixed_kernels(KERNEL_LIST, KERNEL_PROB, self.ks, [0.2, 3], [0.2, 3],
                                     [-math.pi, math.pi], [0.5, 4], [1, 2], noise_range=None)
        return torch.FloatTensor(k)

    def __getitem__(self, i):
        img = cv2.imread(self.files[i])[..., ::-1].astype(np.float32) / 255.0
        h, w = img.shape[:2]
        if min(h, w) < self.gt_size:
            img = cv2.copyMakeBorder(img, 0, max(0, self.gt_size - h), 0, max(0, self.gt_size - w),
                                     cv2.BORDER_REFLECT_101)
            h, w = img.shape[:2]
        y, x = random.randint(0, h - self.gt_size), random.randint(0, w - self.gt_size)
        img = img[y:y + self.gt_size, x:x + self.gt_size]
        if random.random() < 0.5:
            img = img[:, ::-1]
        gt = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        return gt, self._kernel()


class Degrader:
    def __init__(self, device, scale=4):
        self.jpeger = DiffJPEG(differentiable=False).to(device)
        self.scale = scale

    @torch.no_grad()
    def __call__(self, gt, kernel):
        h, w = gt.shape[-2:]
        out = filter2D(gt, kernel)
        mode = random.choice(["area", "bilinear", "bicubic"])
        out = F.interpolate(out, scale_factor=random.uniform(0.15, 1.5), mode=mode)
        if random.random() < 0.5:
            out = random_add_gaussian_noise_pt(out, sigma_range=[1, 30], clip=True, rounds=False, gray_prob=0.4)
        else:
            out = random_add_poisson_noise_pt(out, scale_range=[0.05, 3], gray_prob=0.4, clip=True, rounds=False)
        q = out.new_zeros(out.size(0)).uniform_(30, 95)
        out = self.jpeger(out.clamp(0, 1), quality=q)
        out = F.interpolate(out, size=(h // self.scale, w // self.scale), mode=random.choice(["area", "bilinear", "bicubic"]))
        return (out * 255.0).round().clamp(0, 255) / 255.0


def psnr(sr, gt):
    sr = (sr.clamp(0, 1) * 255).round()
    return 10 * torch.log10(255.0 ** 2 / ((sr - gt * 255) ** 2).mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gt_dir", required=True)
    ap.add_argument("--val_dir", default="/data/RealSRSet_pairs")
    ap.add_argument("--init", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_per_gpu", type=int, default=12)
    ap.add_argument("--iters", type=int, default=1000000)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--ema", type=float, default=0.999)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    model_dir = os.path.join(args.out, "models")
    os.makedirs(model_dir, exist_ok=True)

    torch.manual_seed(0)
    net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=4)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        net_g.load_state_dict(sd.get("params_ema", sd.get("params", sd)))
    net_g.to(device)
    net_g_ema = copy.deepcopy(net_g).eval().requires_grad_(False)
    optimizer = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [1000000], 0.5)

    start_iter = 0
    latest = os.path.join(model_dir, "net_g_latest.pth")
    if os.path.exists(latest):
        ck = torch.load(latest, map_location="cpu")
        net_g.load_state_dict(ck["params"])
        net_g_ema.load_state_dict(ck["params_ema"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_iter = ck["iter"]
    model = DDP(net_g, device_ids=[local_rank])

    dataset = GTWithKernel(args.gt_dir)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=5,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    degrade = Degrader(device)
    val_pairs = sorted(glob(os.path.join(args.val_dir, "lq", "*.png")))[:20]

    it, epoch, tic = start_iter, start_iter // len(loader), time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for gt, kernel in loader:
            gt, kernel = gt.to(device, non_blocking=True), kernel.to(device, non_blocking=True)
            lq = degrade(gt, kernel)
            loss = F.l1_loss(model(lq), gt)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                for pe, p in zip(net_g_ema.parameters(), net_g.parameters()):
                    pe.mul_(args.ema).add_(p.detach(), alpha=1 - args.ema)
            it += 1

            if rank == 0 and it % 100 == 0:
                print(f"[iter {it:07d}] l_pix {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.1e} "
                      f"({time.time() - tic:.1f}s / 100 it)", flush=True)
                tic = time.time()
            if it % args.save_every == 0:
                state = {"iter": it, "params": net_g.state_dict(), "params_ema": net_g_ema.state_dict(),
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
                torch.save(state, os.path.join(model_dir, f"net_g_{it}.pth"))
                torch.save(state, latest)
                if rank == 0:
                    with torch.no_grad():
                        vals = []
                        for lp in val_pairs:
                            lq_v = torch.from_numpy(cv2.imread(lp)[..., ::-1].transpose(2, 0, 1).copy()).float() / 255
                            gt_v = cv2.imread(lp.replace(os.sep + "lq" + os.sep, os.sep + "gt" + os.sep))[..., ::-1]
                            gt_v = torch.from_numpy(gt_v.transpose(2, 0, 1).copy()).float() / 255
                            sr = net_g_ema(lq_v.unsqueeze(0).to(device))
                            vals.append(psnr(sr, gt_v.unsqueeze(0).to(device)).item())
                    print(f"[iter {it:07d}] EMA PSNR on {len(vals)} real pairs: {np.mean(vals):.3f}", flush=True)
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
