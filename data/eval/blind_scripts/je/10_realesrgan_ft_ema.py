"""Fine-tune a Real-ESRGAN x4 generator on paired in-domain data (e.g. scanned film frames).

GAN + perceptual + L1, U-Net SN discriminator, EMA generator for evaluation,
automatic resume from <out>/latest.pth.

    torchrun --nproc_per_node=4 10_realesrgan_ft_ema.py --train /data/film/train --val /data/film/val \
        --init weights/RealESRGAN_x4plus.pth --wandb_project film-sr
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
import torch.nn.functional as F
from basicsr.archs.discriminator_arch import UNetDiscriminatorSN
from basicsr.archs.rrdbnet_arch import RRDBNet
from basicsr.losses import PerceptualLoss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class FramePairs(Dataset):
    def __init__(self, root, gt_size=256, train=True):
        self.lq = sorted(glob(os.path.join(root, "lq", "*.png")))
        self.gt = [p.replace(os.sep + "lq" + os.sep, os.sep + "gt" + os.sep) for p in self.lq]
        self.gt_size, self.train = gt_size, train

    def __len__(self):
        return len(self.lq)

    def __getitem__(self, i):
        lq = cv2.imread(self.lq[i])[..., ::-1].astype(np.float32) / 255.0
        gt = cv2.imread(self.gt[i])[..., ::-1].astype(np.float32) / 255.0
        if self.train:
            p = self.gt_size // 4
            y, x = random.randint(0, lq.shape[0] - p), random.randint(0, lq.shape[1] - p)
            lq, gt = lq[y:y + p, x:x + p], gt[4 * y:4 * (y + p), 4 * x:4 * (x + p)]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
        return (torch.from_numpy(np.ascontiguousarray(lq.transpose(2, 0, 1))),
                torch.from_numpy(np.ascontiguousarray(gt.transpose(2, 0, 1))))


def psnr_ssim(sr, gt):
    sr = (sr.clamp(0, 1) * 255).round().double()
    gt = (gt * 255).round().double()
    psnr = 10 * torch.log10(255.0 ** 2 / F.mse_loss(sr, gt))
    g = torch.exp(-((torch.arange(11, device=sr.device, dtype=torch.float64) - 5) ** 2) / 4.5)
    k = (g[:, None] * g[None, :] / g.sum() ** 2).expand(3, 1, 11, 11)
    mx, my = F.conv2d(sr, k, groups=3), F.conv2d(gt, k, groups=3)
    sxx = F.conv2d(sr * sr, k, groups=3) - mx ** 2
    syy = F.conv2d(gt * gt, k, groups=3) - my ** 2
    sxy = F.conv2d(sr * gt, k, groups=3) - mx * my
    c1, c2 = 6.5025, 58.5225
    ssim = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (sxx + syy + c2))
    return psnr, ssim.mean()


@torch.no_grad()
def evaluate(net, val_set, device, rank, world):
    # each rank takes every world-th image; sums and counts are reduced, so every image counts once
    net.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for i in range(rank, len(val_set), world):
        lq, gt = val_set[i]
        sr = net(lq.unsqueeze(0).to(device))
        p, s = psnr_ssim(sr, gt.unsqueeze(0).to(device))
        acc += torch.stack([p, s, torch.ones_like(p)])
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", default="experiments/film_realesrgan")
    ap.add_argument("--batch_per_gpu", type=int, default=6)
    ap.add_argument("--iters", type=int, default=100000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--eval_every", type=int, default=2500)
    ap.add_argument("--wandb_project", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    net_g = RRDBNet(num_in_ch=3, num_out_ch=3, num_feat=64, num_block=23, num_grow_ch=32, scale=4)
    init = torch.load(args.init, map_location="cpu")
    net_g.load_state_dict(init.get("params_ema", init.get("params", init)), strict=True)
    net_g.to(dev)
    net_d = UNetDiscriminatorSN(num_in_ch=3, num_feat=64, skip_connection=True).to(dev)
    ema_g = copy.deepcopy(net_g).eval().requires_grad_(False)
    cri_per = PerceptualLoss({"conv1_2": 0.1, "conv2_2": 0.1, "conv3_4": 1, "conv4_4": 1, "conv5_4": 1},
                             vgg_type="vgg19", perceptual_weight=1.0, style_weight=0.0, range_norm=False).to(dev)

    opt_g = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=args.lr, betas=(0.9, 0.99))
    start_it = 0
    latest = os.path.join(args.out, "latest.pth")
    if os.path.isfile(latest):  # auto-resume; the out dir is on the shared file system
        ck = torch.load(latest, map_location="cpu")
        net_g.load_state_dict(ck["net_g"])
        net_d.load_state_dict(ck["net_d"])
        ema_g.load_state_dict(ck["ema_g"])
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        start_it = ck["iter"]
    net_g = DDP(net_g, device_ids=[local_rank])
    net_d = DDP(net_d, device_ids=[local_rank])

    train_set, val_set = FramePairs(args.train), FramePairs(args.val, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb_project:
            import wandb
            run = wandb.init(project=args.wandb_project, config=vars(args), resume="allow")

    it, epoch, tic = start_it, start_it // len(loader), time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(dev, non_blocking=True), gt.to(dev, non_blocking=True)
            it += 1
            # generator step, D frozen
            for p in net_d.parameters():
                p.requires_grad_(False)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = net_g(lq)
            out = out.float()
            l_pix = F.l1_loss(out, gt)
            l_per, _ = cri_per(out, gt)
            l_gan = F.softplus(-net_d(out)).mean()
            opt_g.zero_grad(set_to_none=True)
            (l_pix + l_per + 0.1 * l_gan).backward()
            opt_g.step()
            with torch.no_grad():
                for pe, pm in zip(ema_g.parameters(), net_g.module.parameters()):
                    pe.lerp_(pm, 1.0 - args.ema)

            # discriminator step: real and fake backward separately
            for p in net_d.parameters():
                p.requires_grad_(True)
            opt_d.zero_grad(set_to_none=True)
            l_d_real = F.softplus(-net_d(gt)).mean()
            l_d_real.backward()
            l_d_fake = F.softplus(net_d(out.detach())).mean()
            l_d_fake.backward()
            opt_d.step()

            if rank == 0 and it % 100 == 0:
                stats = {"l_pix": l_pix.item(), "l_percep": l_per.item(), "l_g_gan": l_gan.item(),
                         "l_d_real": l_d_real.item(), "l_d_fake": l_d_fake.item(),
                         "sec_per_iter": (time.time() - tic) / 100}
                tic = time.time()
                print(f"it {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in stats.items()), flush=True)
                if run is not None:
                    run.log(stats, step=it)

            if it % args.eval_every == 0 or it == args.iters:
                psnr, ssim = evaluate(ema_g, val_set, dev, rank, world)
                if rank == 0:
                    print(f"[eval] it {it}: EMA PSNR {psnr:.3f} SSIM {ssim:.4f}", flush=True)
                    if run is not None:
                        run.log({"val/psnr": psnr, "val/ssim": ssim}, step=it)
                    ck = {"iter": it, "net_g": net_g.module.state_dict(), "net_d": net_d.module.state_dict(),
                          "ema_g": ema_g.state_dict(), "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict()}
                    torch.save(ck, latest + ".tmp")
                    os.replace(latest + ".tmp", latest)
                    torch.save({"params_ema": ema_g.state_dict()}, os.path.join(args.out, f"net_g_ema_{it}.pth"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
