"""Two-stage ESRGAN-style training with one script.

stage 1 (psnr): RRDBNet with L1 only.
stage 2 (gan):  start from the stage-1 generator, add VGG perceptual loss and a U-Net SN discriminator.

    torchrun --nproc_per_node=8 08_esrgan_two_stage.py --stage psnr --out runs/rrdb_psnr
    torchrun --nproc_per_node=8 08_esrgan_two_stage.py --stage gan --out runs/rrdb_gan \
        --pretrained_g runs/rrdb_psnr/net_g_final.pth
"""
import argparse
import copy
import os
import random
import time
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from basicsr.archs.discriminator_arch import UNetDiscriminatorSN
from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.losses import PerceptualLoss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", choices=["psnr", "gan"], required=True)
    p.add_argument("--gt_dir", default="/data/DF2K/HR_sub")
    p.add_argument("--lq_dir", default="/data/DF2K/LR_bicubic_X4_sub")
    p.add_argument("--val_dir", default="/data/benchmark/Set14")
    p.add_argument("--gt_size", type=int, default=None)
    p.add_argument("--batch_per_gpu", type=int, default=2)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--pretrained_g", default="")
    p.add_argument("--resume", default="")
    p.add_argument("--ema_decay", type=float, default=0.999)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.stage == "psnr":
        args.gt_size = args.gt_size or 128
        args.iters = args.iters or 1000000
        args.lr, args.milestones = 2e-4, [200000, 400000, 600000, 800000]
    else:
        args.gt_size = args.gt_size or 128
        args.iters = args.iters or 400000
        args.lr, args.milestones = 1e-4, [50000, 100000, 200000, 300000]
    return args


class PairedCrops(Dataset):
    def __init__(self, gt_dir, lq_dir, gt_size, scale=4):
        self.gt = sorted(glob(os.path.join(gt_dir, "*.png")))
        self.lq = sorted(glob(os.path.join(lq_dir, "*.png")))
        assert len(self.gt) == len(self.lq)
        self.gt_size, self.scale = gt_size, scale

    def __len__(self):
        return len(self.gt)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt[i])[..., ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(self.lq[i])[..., ::-1].astype(np.float32) / 255.0
        lsz, s = self.gt_size // self.scale, self.scale
        y, x = random.randint(0, lq.shape[0] - lsz), random.randint(0, lq.shape[1] - lsz)
        lq, gt = lq[y:y + lsz, x:x + lsz], gt[y * s:y * s + self.gt_size, x * s:x * s + self.gt_size]
        if random.random() < 0.5:
            lq, gt = lq[:, ::-1], gt[:, ::-1]
        k = random.randint(0, 3)
        lq, gt = np.rot90(lq, k), np.rot90(gt, k)
        return (torch.from_numpy(lq.transpose(2, 0, 1).copy()), torch.from_numpy(gt.transpose(2, 0, 1).copy()))


def load_val(val_dir, scale=4):
    pairs = []
    for hp in sorted(glob(os.path.join(val_dir, "HR", "*.png"))):
        lp = os.path.join(val_dir, "LR_bicubic", f"X{scale}", os.path.basename(hp).replace(".png", f"x{scale}.png"))
        hr = cv2.imread(hp)[..., ::-1].astype(np.float32) / 255.0
        lr = cv2.imread(lp)[..., ::-1].astype(np.float32) / 255.0
        hr = hr[:lr.shape[0] * scale, :lr.shape[1] * scale]
        pairs.append((torch.from_numpy(lr.transpose(2, 0, 1).copy()), torch.from_numpy(hr.transpose(2, 0, 1).copy())))
    return pairs


def psnr_y(sr, hr, crop=4):
    c = sr.new_tensor([65.481, 128.553, 24.966]).view(1, 3, 1, 1)
    a = (((sr.clamp(0, 1) * 255).round() / 255) * c).sum(1)[..., crop:-crop, crop:-crop]
    b = (hr * c).sum(1)[..., crop:-crop, crop:-crop]
    return 10 * torch.log10(255.0 ** 2 / ((a - b) ** 2).mean())


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=4)
    if args.pretrained_g:
        net_g.load_state_dict(torch.load(args.pretrained_g, map_location="cpu"), strict=True)
    net_g = net_g.to(dev)
    ema_g = copy.deepcopy(net_g).eval().requires_grad_(False)
    net_g = DDP(net_g, device_ids=[local_rank])
    opt_g = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.9, 0.99))
    sched_g = torch.optim.lr_scheduler.MultiStepLR(opt_g, args.milestones, 0.5)

    gan = args.stage == "gan"
    if gan:
        net_d = DDP(UNetDiscriminatorSN(num_in_ch=3, num_feat=64).to(dev), device_ids=[local_rank])
        opt_d = torch.optim.Adam(net_d.parameters(), lr=args.lr, betas=(0.9, 0.99))
        sched_d = torch.optim.lr_scheduler.MultiStepLR(opt_d, args.milestones, 0.5)
        cri_per = PerceptualLoss({"conv1_2": 0.1, "conv2_2": 0.1, "conv3_4": 1, "conv4_4": 1, "conv5_4": 1},
                                 vgg_type="vgg19", perceptual_weight=1.0, style_weight=0).to(dev)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=dev)
        net_g.load_state_dict(ck["net_g"])
        ema_g.load_state_dict(ck["ema_g"])
        opt_g.load_state_dict(ck["opt_g"])
        sched_g.load_state_dict(ck["sched_g"])
        if gan:
            net_d.load_state_dict(ck["net_d"])
            opt_d.load_state_dict(ck["opt_d"])
            sched_d.load_state_dict(ck["sched_d"])
        start = ck["iter"]

    ds = PairedCrops(args.gt_dir, args.lq_dir, args.gt_size)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_pairs = load_val(args.val_dir) if rank == 0 else None
    writer = SummaryWriter(args.out) if rank == 0 else None

    it, epoch, tic = start, start // len(loader), time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(dev, non_blocking=True), gt.to(dev, non_blocking=True)
            it += 1
            if gan:
                for p in net_d.parameters():
                    p.requires_grad = False
            out = net_g(lq)
            l_g = F.l1_loss(out, gt)
            logs = {"l_pix": l_g.item()}
            if gan:
                l_per, _ = cri_per(out, gt)
                l_adv = F.binary_cross_entropy_with_logits(net_d(out), torch.ones_like(out[:, :1]))
                l_g = l_g + l_per + 0.1 * l_adv
                logs.update(l_percep=l_per.item(), l_g_gan=l_adv.item())
            opt_g.zero_grad(set_to_none=True)
            l_g.backward()
            opt_g.step()
            sched_g.step()
            ema_update(ema_g, net_g.module, args.ema_decay)

            if gan:
                for p in net_d.parameters():
                    p.requires_grad = True
                opt_d.zero_grad(set_to_none=True)
                real = net_d(gt)
                l_d_real = F.binary_cross_entropy_with_logits(real, torch.ones_like(real))
                l_d_real.backward()
                fake = net_d(out.detach().clone())
                l_d_fake = F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake))
                l_d_fake.backward()
                opt_d.step()
                sched_d.step()
                logs.update(l_d_real=l_d_real.item(), l_d_fake=l_d_fake.item())

            if rank == 0 and it % 100 == 0:
                for k, v in logs.items():
                    writer.add_scalar(f"train/{k}", v, it)
                print(f"[{args.stage}] iter {it} " + " ".join(f"{k}={v:.4f}" for k, v in logs.items())
                      + f" ({time.time() - tic:.1f}s)", flush=True)
                tic = time.time()

            if it % 5000 == 0 and rank == 0:
                with torch.no_grad():
                    psnr = np.mean([psnr_y(ema_g(l.unsqueeze(0).to(dev)), h.unsqueeze(0).to(dev)).item()
                                    for l, h in val_pairs])
                writer.add_scalar("val/psnr_y_ema", psnr, it)
                ck = {"iter": it, "net_g": net_g.state_dict(), "ema_g": ema_g.state_dict(),
                      "opt_g": opt_g.state_dict(), "sched_g": sched_g.state_dict()}
                if gan:
                    ck.update(net_d=net_d.state_dict(), opt_d=opt_d.state_dict(), sched_d=sched_d.state_dict())
                torch.save(ck, os.path.join(args.out, f"ckpt_{it:07d}.pth"))
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save(net_g.state_dict(), os.path.join(args.out, "net_g_final.pth"))
        torch.save(ema_g.state_dict(), os.path.join(args.out, "net_g_ema_final.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
