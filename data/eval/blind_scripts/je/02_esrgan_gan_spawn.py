"""ESRGAN fine-tuning (RRDBNet + VGG discriminator, RaGAN + perceptual + L1), single node.

Spawns one process per visible GPU itself:
    python 02_esrgan_gan_spawn.py --data_root /data/DF2K_sub --pretrained_g experiments/rrdb_psnr/net_g_final.pth
"""
import argparse
import copy
import glob
import os
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ResidualDenseBlock(nn.Module):
    def __init__(self, nf=64, gc=32):
        super().__init__()
        self.conv1 = nn.Conv2d(nf, gc, 3, 1, 1)
        self.conv2 = nn.Conv2d(nf + gc, gc, 3, 1, 1)
        self.conv3 = nn.Conv2d(nf + 2 * gc, gc, 3, 1, 1)
        self.conv4 = nn.Conv2d(nf + 3 * gc, gc, 3, 1, 1)
        self.conv5 = nn.Conv2d(nf + 4 * gc, nf, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.lrelu(self.conv3(torch.cat((x, x1, x2), 1)))
        x4 = self.lrelu(self.conv4(torch.cat((x, x1, x2, x3), 1)))
        return self.conv5(torch.cat((x, x1, x2, x3, x4), 1)) * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf, gc=32):
        super().__init__()
        self.rdb1, self.rdb2, self.rdb3 = ResidualDenseBlock(nf, gc), ResidualDenseBlock(nf, gc), ResidualDenseBlock(nf, gc)

    def forward(self, x):
        return self.rdb3(self.rdb2(self.rdb1(x))) * 0.2 + x


class RRDBNet(nn.Module):
    def __init__(self, nf=64, nb=23, gc=32):
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


class VGGStyleDiscriminator(nn.Module):
    """Discriminator for 128x128 GT patches."""

    def __init__(self, nf=64):
        super().__init__()
        cfg = [(nf, 1), (nf, 2), (nf * 2, 1), (nf * 2, 2), (nf * 4, 1), (nf * 4, 2),
               (nf * 8, 1), (nf * 8, 2), (nf * 8, 1), (nf * 8, 2)]
        layers, c_in = [], 3
        for i, (c, s) in enumerate(cfg):
            layers.append(nn.Conv2d(c_in, c, 3 if s == 1 else 4, s, 1, bias=(i == 0)))
            if i > 0:
                layers.append(nn.BatchNorm2d(c))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            c_in = c
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(nf * 8 * 4 * 4, 100), nn.LeakyReLU(0.2, True), nn.Linear(100, 1))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class PerceptualLoss(nn.Module):
    def __init__(self):
        super().__init__()
        vgg = torchvision.models.vgg19(weights=torchvision.models.VGG19_Weights.IMAGENET1K_V1).features
        self.vgg = vgg[:35].eval()  # up to conv5_4, before activation
        for p in self.vgg.parameters():
            p.requires_grad = False
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x, gt):
        return F.l1_loss(self.vgg((x - self.mean) / self.std), self.vgg((gt.detach() - self.mean) / self.std))


class ModelEMA:
    def __init__(self, model, decay=0.999):
        self.ema = copy.deepcopy(model).eval()
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1.0 - self.decay)


class SRPairDataset(Dataset):
    def __init__(self, root, scale=4, gt_size=128, train=True):
        self.gt_paths = sorted(glob.glob(os.path.join(root, "HR", "*.png")))
        self.lq_paths = sorted(glob.glob(os.path.join(root, f"LR_bicubic/X{scale}", "*.png")))
        assert len(self.gt_paths) == len(self.lq_paths)
        self.scale, self.gt_size, self.train = scale, gt_size, train

    def __len__(self):
        return len(self.gt_paths)

    @staticmethod
    def _read(path):
        return cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0

    def __getitem__(self, idx):
        gt, lq, s = self._read(self.gt_paths[idx]), self._read(self.lq_paths[idx]), self.scale
        if self.train:
            lp = self.gt_size // s
            top, left = random.randint(0, lq.shape[0] - lp), random.randint(0, lq.shape[1] - lp)
            lq = lq[top:top + lp, left:left + lp]
            gt = gt[top * s:top * s + self.gt_size, left * s:left * s + self.gt_size]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
            if random.random() < 0.5:
                lq, gt = lq.transpose(1, 0, 2), gt.transpose(1, 0, 2)
        else:
            gt = gt[:lq.shape[0] * s, :lq.shape[1] * s]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return to_t(lq), to_t(gt)


def psnr_y(sr, gt, border=4):
    w = torch.tensor([65.481, 128.553, 24.966], device=sr.device).view(1, 3, 1, 1)
    sr_y = ((sr.clamp(0, 1) * 255).round() / 255 * w).sum(1) + 16.0
    gt_y = (gt * w).sum(1) + 16.0
    sr_y, gt_y = sr_y[:, border:-border, border:-border], gt_y[:, border:-border, border:-border]
    return 10 * torch.log10(255.0 ** 2 / ((sr_y - gt_y) ** 2).mean(dim=(1, 2)))


def main_worker(local_rank, ngpus, args):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", world_size=ngpus, rank=local_rank)
    device = torch.device("cuda", local_rank)
    is_main = local_rank == 0

    torch.manual_seed(args.seed)
    net_g = RRDBNet().to(device)
    if args.pretrained_g:
        sd = torch.load(args.pretrained_g, map_location="cpu")
        sd = sd.get("params_ema", sd.get("params", sd))
        net_g.load_state_dict({k.replace("module.", "", 1): v for k, v in sd.items()}, strict=True)
    net_d = nn.SyncBatchNorm.convert_sync_batchnorm(VGGStyleDiscriminator()).to(device)
    ema = ModelEMA(net_g, decay=args.ema_decay)

    if is_main:  # fetch the VGG weights once before the others read the cache
        PerceptualLoss()
    dist.barrier()
    cri_percep = PerceptualLoss().to(device)

    net_g = DDP(net_g, device_ids=[local_rank])
    # D runs twice per step (real and fake) before backward, so keep its buffers out of the forward broadcast
    net_d = DDP(net_d, device_ids=[local_rank], broadcast_buffers=False)

    random.seed(args.seed + local_rank)
    train_set = SRPairDataset(args.data_root, train=True)
    sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=local_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    val_set = SRPairDataset(args.val_root, train=False)

    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-4, betas=(0.9, 0.99))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-4, betas=(0.9, 0.99))
    milestones = [50000, 100000, 200000, 300000]
    sch_g = torch.optim.lr_scheduler.MultiStepLR(opt_g, milestones, 0.5)
    sch_d = torch.optim.lr_scheduler.MultiStepLR(opt_d, milestones, 0.5)
    bce = nn.BCEWithLogitsLoss()

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
    it, epoch = 0, 0
    t0 = time.time()
    while it < args.total_iters:
        sampler.set_epoch(epoch)
        for lq, gt in loader:
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            it += 1

            # ---- generator
            for p in net_d.parameters():
                p.requires_grad = False
            fake = net_g(lq)
            with torch.no_grad():
                real_pred = net_d(gt)
            fake_pred = net_d(fake)
            l_pix = F.l1_loss(fake, gt)
            l_percep = cri_percep(fake, gt)
            l_gan = (bce(real_pred - fake_pred.mean(), torch.zeros_like(real_pred)) +
                     bce(fake_pred - real_pred.mean(), torch.ones_like(fake_pred))) / 2
            l_g = 0.01 * l_pix + l_percep + 0.005 * l_gan
            opt_g.zero_grad(set_to_none=True)
            l_g.backward()
            opt_g.step()
            ema.update(net_g.module)

            # ---- discriminator
            for p in net_d.parameters():
                p.requires_grad = True
            fake_pred = net_d(fake.detach())
            real_pred = net_d(gt)
            l_d = (bce(real_pred - fake_pred.mean(), torch.ones_like(real_pred)) +
                   bce(fake_pred - real_pred.mean(), torch.zeros_like(fake_pred))) / 2
            opt_d.zero_grad(set_to_none=True)
            l_d.backward()
            opt_d.step()
            sch_g.step()
            sch_d.step()

            if is_main and it % 100 == 0:
                print(f"[{it}] l_pix {l_pix.item():.4f} l_percep {l_percep.item():.4f} l_gan {l_gan.item():.4f} "
                      f"l_d {l_d.item():.4f} ({time.time() - t0:.1f}s)", flush=True)
                t0 = time.time()

            if it % args.val_every == 0:
                if is_main:
                    with torch.no_grad():
                        vals = [psnr_y(ema.ema(v_lq.unsqueeze(0).to(device)), v_gt.unsqueeze(0).to(device)).item()
                                for v_lq, v_gt in val_set]
                    print(f"[{it}] EMA val PSNR(Y) {np.mean(vals):.3f} on {len(vals)} images", flush=True)
                    torch.save({"params": net_g.module.state_dict(), "params_ema": ema.ema.state_dict(),
                                "net_d": net_d.module.state_dict(), "iter": it},
                               os.path.join(args.out_dir, f"esrgan_{it:06d}.pth"))
                dist.barrier()
            if it >= args.total_iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--val_root", default="/data/benchmark/Set14")
    parser.add_argument("--pretrained_g", default="")
    parser.add_argument("--batch_per_gpu", type=int, default=4)
    parser.add_argument("--total_iters", type=int, default=400000)
    parser.add_argument("--val_every", type=int, default=5000)
    parser.add_argument("--ema_decay", type=float, default=0.999)
    parser.add_argument("--out_dir", default="experiments/esrgan")
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args))
