"""RCAN x4 training on DIV2K sub-images.

DIV2K 2K images are slow to decode, so they are cropped once into 480x480 HR / 120x120 LR
sub-images (step 240 / 60) next to the originals, then patches are sampled from those.

    torchrun --nproc_per_node=8 05_rcan_div2k_subimages.py --div2k /data/DIV2K
"""
import argparse
import os
import os.path as osp
import random
import time
from glob import glob
from multiprocessing import Pool

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


# ------------------------------------------------------------------ sub-image extraction
def _crop_one(path, out_dir, crop, step, thresh):
    img = cv2.imread(path, cv2.IMREAD_UNCHANGED)
    h, w = img.shape[:2]
    name = osp.splitext(osp.basename(path))[0]
    hs = list(range(0, h - crop + 1, step))
    ws = list(range(0, w - crop + 1, step))
    if h - (hs[-1] + crop) > thresh:
        hs.append(h - crop)
    if w - (ws[-1] + crop) > thresh:
        ws.append(w - crop)
    idx = 0
    for y in hs:
        for x in ws:
            idx += 1
            patch = np.ascontiguousarray(img[y:y + crop, x:x + crop])
            cv2.imwrite(osp.join(out_dir, f"{name}_s{idx:03d}.png"), patch, [cv2.IMWRITE_PNG_COMPRESSION, 3])
    return name


def extract_subimages(in_dir, out_dir, crop, step, thresh, n_thread=16):
    os.makedirs(out_dir, exist_ok=True)
    paths = sorted(glob(osp.join(in_dir, "*.png")))
    with Pool(n_thread) as pool:
        pool.starmap(_crop_one, [(p, out_dir, crop, step, thresh) for p in paths])


def prepare_div2k(root, scale):
    hr_sub = osp.join(root, "DIV2K_train_HR_sub")
    lr_sub = osp.join(root, f"DIV2K_train_LR_bicubic_X{scale}_sub")
    if not osp.isdir(hr_sub):
        extract_subimages(osp.join(root, "DIV2K_train_HR"), hr_sub, 480, 240, 48)
    if not osp.isdir(lr_sub):
        extract_subimages(osp.join(root, f"DIV2K_train_LR_bicubic/X{scale}"), lr_sub,
                          480 // scale, 240 // scale, 48 // scale)
    return hr_sub, lr_sub


# ------------------------------------------------------------------ RCAN
class CALayer(nn.Module):
    def __init__(self, c, reduction=16):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(nn.Conv2d(c, c // reduction, 1), nn.ReLU(inplace=True),
                                nn.Conv2d(c // reduction, c, 1), nn.Sigmoid())

    def forward(self, x):
        return x * self.fc(self.pool(x))


class RCAB(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, 1, 1), nn.ReLU(inplace=True), nn.Conv2d(c, c, 3, 1, 1), CALayer(c))

    def forward(self, x):
        return x + self.body(x)


class ResidualGroup(nn.Module):
    def __init__(self, c, n_rcab):
        super().__init__()
        self.body = nn.Sequential(*[RCAB(c) for _ in range(n_rcab)], nn.Conv2d(c, c, 3, 1, 1))

    def forward(self, x):
        return x + self.body(x)


class RCAN(nn.Module):
    def __init__(self, scale=4, n_feats=64, n_groups=10, n_rcab=20):
        super().__init__()
        self.register_buffer("rgb_mean", torch.tensor([0.4488, 0.4371, 0.4040]).view(1, 3, 1, 1))
        self.head = nn.Conv2d(3, n_feats, 3, 1, 1)
        self.body = nn.Sequential(*[ResidualGroup(n_feats, n_rcab) for _ in range(n_groups)],
                                  nn.Conv2d(n_feats, n_feats, 3, 1, 1))
        up = []
        for _ in range(int(np.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, 1, 1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(n_feats, 3, 3, 1, 1))

    def forward(self, x):
        x = self.head(x - self.rgb_mean)
        x = x + self.body(x)
        return self.tail(x) + self.rgb_mean


# ------------------------------------------------------------------ data
class SubImageDataset(Dataset):
    def __init__(self, hr_dir, lr_dir, scale, lr_patch=48):
        self.hr = sorted(glob(osp.join(hr_dir, "*.png")))
        self.lr = sorted(glob(osp.join(lr_dir, "*.png")))
        assert len(self.hr) == len(self.lr), f"{len(self.hr)} HR vs {len(self.lr)} LR sub-images"
        self.scale, self.lr_patch = scale, lr_patch

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.cvtColor(cv2.imread(self.hr[i]), cv2.COLOR_BGR2RGB)
        lr = cv2.cvtColor(cv2.imread(self.lr[i]), cv2.COLOR_BGR2RGB)
        p, s = self.lr_patch, self.scale
        y, x = random.randint(0, lr.shape[0] - p), random.randint(0, lr.shape[1] - p)
        lr, hr = lr[y:y + p, x:x + p], hr[y * s:(y + p) * s, x * s:(x + p) * s]
        k = random.randint(0, 3)
        lr, hr = np.rot90(lr, k), np.rot90(hr, k)
        if random.random() < 0.5:
            lr, hr = lr[:, ::-1], hr[:, ::-1]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float().div_(255.0)
        return to_t(lr), to_t(hr)


class BenchmarkDataset(Dataset):
    def __init__(self, root, scale):
        self.hr = sorted(glob(osp.join(root, "HR", "*.png")))
        self.lr = sorted(glob(osp.join(root, "LR_bicubic", f"X{scale}", "*.png")))
        self.scale = scale

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = cv2.cvtColor(cv2.imread(self.hr[i]), cv2.COLOR_BGR2RGB)
        lr = cv2.cvtColor(cv2.imread(self.lr[i]), cv2.COLOR_BGR2RGB)
        hr = hr[:lr.shape[0] * self.scale, :lr.shape[1] * self.scale]
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))).float().div_(255.0)
        return to_t(lr), to_t(hr)


def y_psnr(sr, hr, border):
    sr = (sr.clamp(0, 1) * 255).round()
    hr = hr * 255
    coef = torch.tensor([65.481, 128.553, 24.966], device=sr.device).view(1, 3, 1, 1) / 255.0
    diff = ((sr - hr) * coef).sum(1)[:, border:-border, border:-border]
    return 10 * torch.log10(255.0 ** 2 / diff.pow(2).mean(dim=(1, 2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--div2k", default="/data/DIV2K")
    ap.add_argument("--benchmark", default="/data/benchmark/Urban100")
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=2, help="per GPU; 8 GPUs x 2 = 16 as in the paper")
    ap.add_argument("--iters", type=int, default=300000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default="experiments/rcan_x4")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")

    hr_sub, lr_sub = prepare_div2k(args.div2k, args.scale)
    train_set = SubImageDataset(hr_sub, lr_sub, args.scale)
    val_set = BenchmarkDataset(args.benchmark, args.scale)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    torch.manual_seed(1)
    model = DDP(RCAN(args.scale).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=200000 // 2, gamma=0.5)
    writer = SummaryWriter(osp.join(args.out, "tb")) if rank == 0 else None

    it, epoch = 0, 0
    start = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lr_img, hr_img in loader:
            lr_img, hr_img = lr_img.to(dev, non_blocking=True), hr_img.to(dev, non_blocking=True)
            loss = F.l1_loss(model(lr_img), hr_img)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            it += 1
            if writer is not None and it % 200 == 0:
                writer.add_scalar("train/l1", loss.item(), it)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], it)
                print(f"it {it} l1 {loss.item():.4f} {(time.time() - start) / it:.3f}s/it", flush=True)
            if it % 10000 == 0:
                model.eval()
                acc = torch.zeros(2, device=dev)
                with torch.no_grad():
                    for i in range(rank, len(val_set), world):
                        lr_v, hr_v = val_set[i]
                        sr = model.module(lr_v.unsqueeze(0).to(dev))
                        acc[0] += y_psnr(sr, hr_v.unsqueeze(0).to(dev), args.scale).sum()
                        acc[1] += 1
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    writer.add_scalar("val/psnr_y", (acc[0] / acc[1]).item(), it)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save({"it": it, "model": model.module.state_dict(), "opt": opt.state_dict()},
                               osp.join(args.out, f"rcan_{it}.pth"))
            if it >= args.iters:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
