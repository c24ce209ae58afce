"""Blind face restoration GAN (512x512 FFHQ, synthetic degradations), fp16 autocast.

Generator: residual U-Net; discriminator: PatchGAN with spectral norm;
losses: L1 + LPIPS(vgg) + hinge GAN. EMA generator is used for validation on CelebA-Test.

    torchrun --nproc_per_node=8 19_face_restore_gan_amp.py --ffhq /data/ffhq512 --val /data/celeba_test
"""
import argparse
import copy
import logging
import os
import random
import time
from glob import glob

import cv2
import lpips
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import spectral_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("facegan")


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.skip(x) + self.conv2(F.leaky_relu(self.conv1(F.leaky_relu(x, 0.2)), 0.2))


class UNetG(nn.Module):
    def __init__(self, ch=(32, 64, 128, 256, 256, 512)):
        super().__init__()
        self.inp = nn.Conv2d(3, ch[0], 3, 1, 1)
        self.enc = nn.ModuleList([ResBlock(ch[i], ch[i + 1]) for i in range(len(ch) - 1)])
        self.dec = nn.ModuleList([ResBlock(ch[i + 1] * 2, ch[i]) for i in reversed(range(len(ch) - 1))])
        self.out = nn.Conv2d(ch[0], 3, 3, 1, 1)

    def forward(self, x):
        h = self.inp(x)
        skips = []
        for blk in self.enc:
            h = blk(h)
            skips.append(h)
            h = F.avg_pool2d(h, 2)
        for blk in self.dec:
            h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
            h = blk(torch.cat([h, skips.pop()], 1))
        return torch.tanh(self.out(h)) * 0.5 + 0.5


class PatchD(nn.Module):
    def __init__(self, nf=64, n_layers=4):
        super().__init__()
        layers, c = [spectral_norm(nn.Conv2d(3, nf, 4, 2, 1)), nn.LeakyReLU(0.2, True)], nf
        for i in range(1, n_layers):
            layers += [spectral_norm(nn.Conv2d(c, min(c * 2, 512), 4, 2, 1)), nn.LeakyReLU(0.2, True)]
            c = min(c * 2, 512)
        layers += [spectral_norm(nn.Conv2d(c, c, 3, 1, 1)), nn.LeakyReLU(0.2, True), nn.Conv2d(c, 1, 3, 1, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x * 2 - 1)


def degrade(img):
    """GFPGAN-style: blur -> downsample -> noise -> JPEG -> upsample back. img: HxWx3 float32 in [0,1]."""
    h, w = img.shape[:2]
    sigma = random.uniform(0.1, 10)
    out = cv2.GaussianBlur(img, (41, 41), sigma)
    scale = random.uniform(1, 8)
    out = cv2.resize(out, (int(w / scale), int(h / scale)), interpolation=cv2.INTER_LINEAR)
    out = np.clip(out + np.random.randn(*out.shape).astype(np.float32) * random.uniform(0, 20) / 255.0, 0, 1)
    q = random.randint(60, 100)
    _, enc = cv2.imencode(".jpg", (out * 255).astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, q])
    out = cv2.imdecode(enc, cv2.IMREAD_COLOR).astype(np.float32) / 255.0
    return cv2.resize(out, (w, h), interpolation=cv2.INTER_LINEAR)


class FFHQ(Dataset):
    def __init__(self, root):
        self.files = sorted(glob(os.path.join(root, "*.png")))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        gt = cv2.imread(self.files[i]).astype(np.float32) / 255.0
        if random.random() < 0.5:
            gt = gt[:, ::-1].copy()
        lq = degrade(gt)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a[..., ::-1].transpose(2, 0, 1)))
        return t(lq), t(gt)


@torch.no_grad()
def validate(net, lpips_fn, root, device, rank, world):
    lq_files = sorted(glob(os.path.join(root, "lq", "*.png")))
    acc = torch.zeros(3, device=device)
    for i in range(rank, len(lq_files), world):
        lq = cv2.imread(lq_files[i])[..., ::-1].astype(np.float32) / 255.0
        gt = cv2.imread(lq_files[i].replace(os.sep + "lq" + os.sep, os.sep + "gt" + os.sep))[..., ::-1]
        lq = torch.from_numpy(lq.transpose(2, 0, 1).copy()).unsqueeze(0).to(device)
        gt = torch.from_numpy(gt.astype(np.float32).transpose(2, 0, 1).copy()).unsqueeze(0).to(device) / 255.0
        out = net(lq).clamp(0, 1)
        acc[0] += 10 * torch.log10(1.0 / F.mse_loss((out * 255).round() / 255, gt))
        acc[1] += lpips_fn(out * 2 - 1, gt * 2 - 1).mean()
        acc[2] += 1
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ffhq", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="experiments/face_gan")
    ap.add_argument("--batch_per_gpu", type=int, default=4)
    ap.add_argument("--iters", type=int, default=800000)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--w_lpips", type=float, default=1.0)
    ap.add_argument("--w_gan", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s")

    torch.manual_seed(0)
    net_g, net_d = UNetG().to(device), PatchD().to(device)
    ema_g = copy.deepcopy(net_g).eval().requires_grad_(False)
    g, d = DDP(net_g, device_ids=[local_rank]), DDP(net_d, device_ids=[local_rank])
    lpips_fn = lpips.LPIPS(net="vgg").to(device).eval().requires_grad_(False)
    opt_g = torch.optim.Adam(g.parameters(), lr=args.lr, betas=(0.5, 0.99))
    opt_d = torch.optim.Adam(d.parameters(), lr=args.lr, betas=(0.5, 0.99))
    scaler = torch.cuda.amp.GradScaler()

    ds = FFHQ(args.ffhq)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    it, epoch, tic = 0, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            it += 1
            # generator
            d.requires_grad_(False)
            with torch.autocast("cuda", dtype=torch.float16):
                out = g(lq)
                l_pix = F.l1_loss(out, gt)
                l_lp = lpips_fn(out * 2 - 1, gt * 2 - 1).mean()
                l_adv = -d(out).mean()
                l_g = l_pix + args.w_lpips * l_lp + args.w_gan * l_adv
            if not torch.isfinite(l_g):
                logger.warning("non-finite generator loss at iter %d, skipping batch", it)
                opt_g.zero_grad(set_to_none=True)
                continue
            opt_g.zero_grad(set_to_none=True)
            scaler.scale(l_g).backward()
            scaler.step(opt_g)

            # discriminator (hinge)
            d.requires_grad_(True)
            with torch.autocast("cuda", dtype=torch.float16):
                l_d = F.relu(1 - d(gt)).mean() + F.relu(1 + d(out.detach())).mean()
            opt_d.zero_grad(set_to_none=True)
            scaler.scale(l_d).backward()
            scaler.step(opt_d)
            scaler.update()

            with torch.no_grad():
                for pe, p in zip(ema_g.parameters(), net_g.parameters()):
                    pe.lerp_(p, 1 - 0.999)

            if rank == 0 and it % 100 == 0:
                logger.info("iter %d l_pix %.4f l_lpips %.4f l_adv %.4f l_d %.4f scale %.0f (%.1fs)", it,
                            l_pix.item(), l_lp.item(), l_adv.item(), l_d.item(), scaler.get_scale(),
                            time.time() - tic)
                tic = time.time()
            if it % 10000 == 0:
                psnr, lp = validate(ema_g, lpips_fn, args.val, device, rank, world)
                logger.info("[val %d] EMA PSNR %.3f LPIPS %.4f", it, psnr, lp)
                if rank == 0:
                    torch.save({"iter": it, "net_g": net_g.state_dict(), "net_d": net_d.state_dict(),
                                "ema_g": ema_g.state_dict(), "opt_g": opt_g.state_dict(),
                                "opt_d": opt_d.state_dict(), "scaler": scaler.state_dict()},
                               os.path.join(args.out, f"ckpt_{it:07d}.pth"))
            if it >= args.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
