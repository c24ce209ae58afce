"""NAFSSR-T style stereo SR x4 for the dual-camera module (left/right views share weights,
stereo cross-attention between views).  Trained on Flickr1024 + our rig captures.

    python 17_nafssr_stereo_sr.py --train-root /data/stereo/train_patches --val-root /data/stereo/val --gpus 4
"""
import argparse
import os
import random
from glob import glob

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class LayerNorm2d(nn.Module):
    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, c, 1, 1))
        self.bias = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(1, keepdim=True)
        var = ((x - mu) ** 2).mean(1, keepdim=True)
        return (x - mu) / (var + self.eps).sqrt() * self.weight + self.bias


class NAFBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm2d(c), LayerNorm2d(c)
        self.conv1 = nn.Conv2d(c, 2 * c, 1)
        self.conv2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c)
        self.sca = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, c, 1))
        self.conv3 = nn.Conv2d(c, c, 1)
        self.conv4 = nn.Conv2d(c, 2 * c, 1)
        self.conv5 = nn.Conv2d(c, c, 1)
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, inp):
        a, b = self.conv2(self.conv1(self.norm1(inp))).chunk(2, 1)
        x = a * b
        y = inp + self.conv3(x * self.sca(x)) * self.beta
        a, b = self.conv4(self.norm2(y)).chunk(2, 1)
        return y + self.conv5(a * b) * self.gamma


class SCAM(nn.Module):
    """Stereo cross-attention along the epipolar (row) direction."""

    def __init__(self, c):
        super().__init__()
        self.scale = c ** -0.5
        self.norm_l, self.norm_r = LayerNorm2d(c), LayerNorm2d(c)
        self.l_proj1, self.r_proj1 = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.l_proj2, self.r_proj2 = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.beta = nn.Parameter(torch.zeros(1, c, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(1, c, 1, 1))

    def forward(self, x_l, x_r):
        q_l = self.l_proj1(self.norm_l(x_l)).permute(0, 2, 3, 1)        # B H W C
        q_r_t = self.r_proj1(self.norm_r(x_r)).permute(0, 2, 1, 3)      # B H C W
        v_l = self.l_proj2(x_l).permute(0, 2, 3, 1)
        v_r = self.r_proj2(x_r).permute(0, 2, 3, 1)
        attn = (q_l @ q_r_t) * self.scale                               # B H W W
        f_r2l = (attn.softmax(-1) @ v_r).permute(0, 3, 1, 2)
        f_l2r = (attn.transpose(-1, -2).softmax(-1) @ v_l).permute(0, 3, 1, 2)
        return x_l + f_r2l * self.beta, x_r + f_l2r * self.gamma


class NAFSSR(nn.Module):
    def __init__(self, up_scale=4, width=48, num_blks=16):
        super().__init__()
        self.up_scale = up_scale
        self.intro = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(NAFBlock(width) for _ in range(num_blks))
        self.fusions = nn.ModuleList(SCAM(width) for _ in range(num_blks))
        self.up = nn.Sequential(nn.Conv2d(width, 3 * up_scale ** 2, 3, padding=1), nn.PixelShuffle(up_scale))

    def forward(self, lr_l, lr_r):
        f_l, f_r = self.intro(lr_l), self.intro(lr_r)
        for blk, fuse in zip(self.blocks, self.fusions):
            f_l, f_r = fuse(blk(f_l), blk(f_r))
        base_l = F.interpolate(lr_l, scale_factor=self.up_scale, mode="bilinear", align_corners=False)
        base_r = F.interpolate(lr_r, scale_factor=self.up_scale, mode="bilinear", align_corners=False)
        return self.up(f_l) + base_l, self.up(f_r) + base_r


class StereoPairs(Dataset):
    """Each sample folder holds hr0.png / hr1.png (left / right) and lr0.png / lr1.png."""

    def __init__(self, root, lr_patch=None, scale=4):
        self.dirs = sorted(d for d in glob(os.path.join(root, "*")) if os.path.isdir(d))
        self.lr_patch, self.scale = lr_patch, scale

    def __len__(self):
        return len(self.dirs)

    @staticmethod
    def _read(p):
        return cv2.imread(p)[:, :, ::-1].astype(np.float32) / 255.0

    def __getitem__(self, i):
        d = self.dirs[i]
        hl, hr_ = self._read(os.path.join(d, "hr0.png")), self._read(os.path.join(d, "hr1.png"))
        ll, lr_ = self._read(os.path.join(d, "lr0.png")), self._read(os.path.join(d, "lr1.png"))
        if self.lr_patch:
            ph, pw = self.lr_patch
            s = self.scale
            y, x = random.randint(0, ll.shape[0] - ph), random.randint(0, ll.shape[1] - pw)
            ll, lr_ = ll[y:y + ph, x:x + pw], lr_[y:y + ph, x:x + pw]
            hl, hr_ = hl[y * s:(y + ph) * s, x * s:(x + pw) * s], hr_[y * s:(y + ph) * s, x * s:(x + pw) * s]
            if random.random() < 0.5:
                # horizontal flip swaps the roles of the two views
                ll, lr_, hl, hr_ = lr_[:, ::-1], ll[:, ::-1], hr_[:, ::-1], hl[:, ::-1]
            if random.random() < 0.5:
                ll, lr_, hl, hr_ = ll[::-1], lr_[::-1], hl[::-1], hr_[::-1]
            if random.random() < 0.5:
                ll, lr_, hl, hr_ = lr_, ll, hr_, hl
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
        return t(ll), t(lr_), t(hl), t(hr_)


def train_worker(local_rank, cfg, world_size):
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg.port}",
                            rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed + local_rank)

    train_set = StereoPairs(cfg.train_root, lr_patch=(30, 90))
    val_set = StereoPairs(cfg.val_root)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=local_rank, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_per_gpu, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    net = NAFSSR(up_scale=4, width=cfg.width, num_blks=cfg.blocks).to(device)
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.9), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, cfg.epochs * len(loader), eta_min=1e-7)

    if local_rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (ll, lr_, hl, hr_) in enumerate(loader):
            ll, lr_ = ll.to(device, non_blocking=True), lr_.to(device, non_blocking=True)
            hl, hr_ = hl.to(device, non_blocking=True), hr_.to(device, non_blocking=True)
            sr_l, sr_r = model(ll, lr_)
            loss = F.mse_loss(sr_l, hl) + F.mse_loss(sr_r, hr_)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            if local_rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(loader)} mse {loss.item():.6f}", flush=True)

        net.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for j in range(local_rank, len(val_set), world_size):
                ll, lr_, hl, hr_ = (t[None].to(device) for t in val_set[j])
                sr_l, sr_r = net(ll, lr_)
                for sr, hr in ((sr_l, hl), (sr_r, hr_)):
                    sr = torch.round(sr.clamp(0, 1) * 255) / 255
                    acc[0] += 10 * torch.log10(1 / F.mse_loss(sr.double(), hr.double()))
                    acc[1] += 1
        dist.all_reduce(acc)
        if local_rank == 0:
            print(f"== epoch {epoch}: val PSNR (L+R avg) {(acc[0] / acc[1]).item():.3f} dB", flush=True)
            torch.save({"net": net.state_dict(), "epoch": epoch}, os.path.join(cfg.out, "nafssr_latest.pth"))

    dist.destroy_process_group()


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-root", required=True)
    ap.add_argument("--val-root", required=True)
    ap.add_argument("--out", default="experiments/nafssr_t_x4")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--port", type=int, default=23456)
    ap.add_argument("--width", type=int, default=48)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch-per-gpu", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=10)
    return ap.parse_args()


if __name__ == "__main__":
    cfg = parse_args()
    mp.spawn(train_worker, args=(cfg.gpus, cfg), nprocs=cfg.gpus, join=True)
