"""EDSR x4 super-resolution training on DIV2K (BasicSR-like options file).

Multi-GPU:
    python -m torch.distributed.launch --nproc_per_node=4 --master_port=4321 \
        train_sr.py -opt options/train_EDSR_Lx4.yml --launcher pytorch
Single GPU:
    python train_sr.py -opt options/train_EDSR_Lx4.yml
"""
import argparse
import glob
import math
import os
import os.path as osp
import random
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ------------------------------------------------------------------ options / dist
def parse_options():
    parser = argparse.ArgumentParser()
    parser.add_argument("-opt", type=str, required=True, help="Path to option YAML file.")
    parser.add_argument("--launcher", choices=["none", "pytorch"], default="none")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    with open(args.opt) as f:
        opt = yaml.safe_load(f)
    opt["dist"] = args.launcher != "none"
    return args, opt


def init_dist(local_rank, backend="nccl"):
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)


def get_dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ------------------------------------------------------------------ data
class PairedPatchDataset(Dataset):
    def __init__(self, gt_dir, lq_dir, scale, gt_size=192, train=True):
        self.gt_paths = sorted(glob.glob(osp.join(gt_dir, "*.png")))
        self.lq_paths = [osp.join(lq_dir, osp.basename(p).replace(".png", f"x{scale}.png")) for p in self.gt_paths]
        self.scale, self.gt_size, self.train = scale, gt_size, train

    def __len__(self):
        return len(self.gt_paths)

    def __getitem__(self, i):
        gt = cv2.imread(self.gt_paths[i], cv2.IMREAD_COLOR)[:, :, ::-1].astype(np.float32) / 255.0
        lq = cv2.imread(self.lq_paths[i], cv2.IMREAD_COLOR)[:, :, ::-1].astype(np.float32) / 255.0
        if self.train:
            lq_size = self.gt_size // self.scale
            h, w = lq.shape[:2]
            top, left = random.randint(0, h - lq_size), random.randint(0, w - lq_size)
            lq = lq[top:top + lq_size, left:left + lq_size]
            gt = gt[top * self.scale:(top + lq_size) * self.scale, left * self.scale:(left + lq_size) * self.scale]
            if random.random() < 0.5:
                lq, gt = lq[:, ::-1], gt[:, ::-1]
            if random.random() < 0.5:
                lq, gt = lq[::-1], gt[::-1]
            if random.random() < 0.5:
                lq, gt = lq.transpose(1, 0, 2), gt.transpose(1, 0, 2)
        to_t = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))
        return to_t(lq), to_t(gt)


# ------------------------------------------------------------------ model
class ResBlock(nn.Module):
    def __init__(self, nf, res_scale=0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(nf, nf, 3, 1, 1), nn.ReLU(True), nn.Conv2d(nf, nf, 3, 1, 1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, num_feat=256, num_block=32, upscale=4, res_scale=0.1,
                 img_range=255.0, rgb_mean=(0.4488, 0.4371, 0.4040)):
        super().__init__()
        self.img_range = img_range
        self.register_buffer("mean", torch.tensor(rgb_mean).view(1, 3, 1, 1))
        self.conv_first = nn.Conv2d(3, num_feat, 3, 1, 1)
        self.body = nn.Sequential(*[ResBlock(num_feat, res_scale) for _ in range(num_block)])
        self.conv_after_body = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        up = []
        for _ in range(int(math.log2(upscale))):
            up += [nn.Conv2d(num_feat, 4 * num_feat, 3, 1, 1), nn.PixelShuffle(2)]
        self.upsample = nn.Sequential(*up)
        self.conv_last = nn.Conv2d(num_feat, 3, 3, 1, 1)

    def forward(self, x):
        x = (x - self.mean) * self.img_range
        x = self.conv_first(x)
        x = self.conv_after_body(self.body(x)) + x
        x = self.conv_last(self.upsample(x))
        return x / self.img_range + self.mean


def calculate_psnr(sr, gt, crop_border):
    sr = sr.clamp(0, 1)[..., crop_border:-crop_border, crop_border:-crop_border]
    gt = gt[..., crop_border:-crop_border, crop_border:-crop_border]
    mse = ((sr * 255).round() - gt * 255).pow(2).mean(dim=(1, 2, 3))
    return (10 * torch.log10(255.0 ** 2 / mse)).sum()


# ------------------------------------------------------------------ main
def main():
    args, opt = parse_options()
    if opt["dist"]:
        init_dist(args.local_rank)
    rank, world_size = get_dist_info()
    device = torch.device("cuda", args.local_rank if opt["dist"] else 0)
    torch.manual_seed(opt["manual_seed"] + rank)
    random.seed(opt["manual_seed"] + rank)

    exp_dir = osp.join("experiments", opt["name"])
    if rank == 0:
        os.makedirs(osp.join(exp_dir, "models"), exist_ok=True)

    dtrain, dval = opt["datasets"]["train"], opt["datasets"]["val"]
    train_set = PairedPatchDataset(dtrain["dataroot_gt"], dtrain["dataroot_lq"], opt["scale"], dtrain["gt_size"])
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True) if opt["dist"] else None
    train_loader = DataLoader(train_set, batch_size=dtrain["batch_size_per_gpu"], shuffle=sampler is None,
                              sampler=sampler, num_workers=dtrain["num_worker_per_gpu"], pin_memory=True,
                              drop_last=True, persistent_workers=True)
    val_set = PairedPatchDataset(dval["dataroot_gt"], dval["dataroot_lq"], opt["scale"], train=False)
    val_indices = list(range(rank, len(val_set), world_size))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_indices), batch_size=1)

    net_g = EDSR(**opt["network_g"]).to(device)
    if opt["dist"]:
        net_g = DistributedDataParallel(net_g, device_ids=[args.local_rank])
    net_g_bare = net_g.module if opt["dist"] else net_g

    train_opt = opt["train"]
    optimizer = torch.optim.Adam(net_g.parameters(), lr=train_opt["lr"], betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, train_opt["milestones"], train_opt["gamma"])
    cri_pix = nn.L1Loss()
    total_iter = train_opt["total_iter"]

    current_iter, epoch = 0, 0
    t0 = time.time()
    while current_iter < total_iter:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for lq, gt in train_loader:
            current_iter += 1
            if current_iter > total_iter:
                break
            lq, gt = lq.to(device, non_blocking=True), gt.to(device, non_blocking=True)
            optimizer.zero_grad()
            l_pix = cri_pix(net_g(lq), gt)
            l_pix.backward()
            optimizer.step()
            scheduler.step()

            if current_iter % opt["logger"]["print_freq"] == 0:
                l = l_pix.detach().clone()
                if opt["dist"]:
                    dist.all_reduce(l)
                    l /= world_size
                if rank == 0:
                    print(f"[epoch:{epoch:3d}, iter:{current_iter:8,d}, lr:({scheduler.get_last_lr()[0]:.3e})] "
                          f"[time: {time.time() - t0:.1f}s] l_pix: {l.item():.4e}", flush=True)

            if current_iter % opt["val"]["val_freq"] == 0:
                net_g.eval()
                psnr = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vlq, vgt in val_loader:
                        sr = net_g_bare(vlq.to(device))
                        psnr += torch.stack([calculate_psnr(sr, vgt.to(device), opt["scale"]),
                                             torch.ones((), device=device)])
                if opt["dist"]:
                    dist.all_reduce(psnr)
                if rank == 0:
                    print(f"# Validation {opt['name']} # psnr: {(psnr[0] / psnr[1]).item():.4f}", flush=True)
                    torch.save({"params": net_g_bare.state_dict(), "iter": current_iter,
                                "optimizer": optimizer.state_dict()},
                               osp.join(exp_dir, "models", f"net_g_{current_iter}.pth"))
                if opt["dist"]:
                    dist.barrier()
                net_g.train()
        epoch += 1

    if opt["dist"]:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
