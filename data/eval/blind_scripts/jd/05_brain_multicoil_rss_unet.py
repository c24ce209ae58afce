"""
fastMRI brain (multi-coil) - RSS U-Net with SSIM+L1 loss, equispaced 4x/8x masks.

Slice metadata (#slices, encoding size, padding) is gathered once by opening every
HDF5 header, which takes ~20 min on the brain train set, and is cached to a pickle.

    torchrun --nproc_per_node=8 05_brain_multicoil_rss_unet.py \
        --data /mnt/fastmri/brain --cache /mnt/fastmri/brain/.slice_cache.pkl
"""
import argparse
import os
import pickle
import xml.etree.ElementTree as ET
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

ISMRMRD_NS = "{http://www.ismrm.org/ISMRMRD}"


def ifft2c(k):
    k = torch.fft.ifftshift(k, dim=(-2, -1))
    return torch.fft.fftshift(torch.fft.ifft2(k, norm="ortho"), dim=(-2, -1))


def rss(x, dim=0):
    return torch.sqrt((x.abs() ** 2).sum(dim))


def equispaced_mask(num_cols, acc, center_frac, offset):
    num_low = round(num_cols * center_frac)
    mask = np.zeros(num_cols, dtype=np.float32)
    pad = (num_cols - num_low + 1) // 2
    mask[pad:pad + num_low] = 1
    adjusted = (acc * (num_low - num_cols)) / (num_low * acc - num_cols)
    mask[np.around(np.arange(offset, num_cols - 1, adjusted)).astype(np.uint)] = 1
    return torch.from_numpy(mask)


def read_header(fname):
    with h5py.File(fname, "r") as hf:
        hdr = ET.fromstring(hf["ismrmrd_header"][()])
        n_slices = hf["kspace"].shape[0]
    enc = hdr.find(f"{ISMRMRD_NS}encoding")
    enc_lim = enc.find(f"{ISMRMRD_NS}encodingLimits").find(f"{ISMRMRD_NS}kspace_encoding_step_1")
    center = int(enc_lim.find(f"{ISMRMRD_NS}center").text)
    maximum = int(enc_lim.find(f"{ISMRMRD_NS}maximum").text) + 1
    return n_slices, {"padding_left": maximum // 2 - center, "padding_right": maximum // 2 - center + maximum}


class BrainSlices(Dataset):
    def __init__(self, root, split, cache_file, accels=(4, 8), center_fracs=(0.08, 0.04), train=True):
        self.split = split
        self.accels, self.center_fracs = accels, center_fracs
        self.train = train
        cache = {}
        if os.path.exists(cache_file):
            with open(cache_file, "rb") as f:
                cache = pickle.load(f)
        if split not in cache:
            samples = []
            for fname in sorted(Path(root, f"multicoil_{split}").glob("*.h5")):
                n, meta = read_header(fname)
                samples += [(str(fname), s, meta) for s in range(n)]
            cache[split] = samples
            with open(cache_file, "wb") as f:
                pickle.dump(cache, f)
        self.samples = cache[split]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        fname, sl, meta = self.samples[i]
        with h5py.File(fname, "r") as hf:
            kspace = torch.from_numpy(hf["kspace"][sl])            # (coils, H, W) complex64
            target = torch.from_numpy(hf["reconstruction_rss"][sl])
            max_val = float(hf.attrs["max"])
        num_cols = kspace.shape[-1]
        if self.train:
            j = np.random.randint(len(self.accels))
            offset = np.random.randint(0, self.accels[j])
        else:
            j, offset = sl % len(self.accels), 0
        mask = equispaced_mask(num_cols, self.accels[j], self.center_fracs[j], offset)
        mask[: meta["padding_left"]] = 0
        mask[meta["padding_right"]:] = 0
        image = rss(ifft2c(kspace * mask))
        h, w = target.shape
        top, left = (image.shape[0] - h) // 2, (image.shape[1] - w) // 2
        image = image[top:top + h, left:left + w]
        scale = image.max() + 1e-9
        return (image / scale)[None], (target / scale)[None], max_val / scale.item()


class UNet(nn.Module):
    def __init__(self, ch=32, depth=4):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.InstanceNorm2d(o),
                                 nn.LeakyReLU(0.2, True),
                                 nn.Conv2d(o, o, 3, padding=1, bias=False), nn.InstanceNorm2d(o),
                                 nn.LeakyReLU(0.2, True))

        self.enc = nn.ModuleList([block(1, ch)] + [block(ch * 2 ** i, ch * 2 ** (i + 1)) for i in range(depth - 1)])
        c = ch * 2 ** (depth - 1)
        self.mid = block(c, 2 * c)
        self.ups = nn.ModuleList()
        self.decs = nn.ModuleList()
        for i in reversed(range(depth)):
            self.ups.append(nn.ConvTranspose2d(ch * 2 ** (i + 1), ch * 2 ** i, 2, 2))
            self.decs.append(block(ch * 2 ** (i + 1), ch * 2 ** i))
        self.head = nn.Conv2d(ch, 1, 1)

    def forward(self, x):
        h, w = x.shape[-2:]
        ph, pw = (-h) % 16, (-w) % 16
        x = F.pad(x, (0, pw, 0, ph), mode="reflect")
        skips = []
        for e in self.enc:
            x = e(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, dec in zip(self.ups, self.decs):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)[..., :h, :w]


class SSIM(nn.Module):
    def __init__(self, win=7, k1=0.01, k2=0.03):
        super().__init__()
        self.win, self.k1, self.k2 = win, k1, k2
        self.register_buffer("w", torch.ones(1, 1, win, win) / win ** 2)
        n = win ** 2
        self.cov_norm = n / (n - 1)

    def forward(self, x, y, data_range):
        dr = data_range[:, None, None, None]
        c1, c2 = (self.k1 * dr) ** 2, (self.k2 * dr) ** 2
        ux, uy = F.conv2d(x, self.w), F.conv2d(y, self.w)
        vx = self.cov_norm * (F.conv2d(x * x, self.w) - ux * ux)
        vy = self.cov_norm * (F.conv2d(y * y, self.w) - uy * uy)
        vxy = self.cov_norm * (F.conv2d(x * y, self.w) - ux * uy)
        s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
        return s.mean(dim=(1, 2, 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache", default="slice_cache.pkl")
    ap.add_argument("--out", default="runs/brain_rss_unet")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--alpha", type=float, default=0.84, help="weight of (1-SSIM) vs L1")
    args = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)

    train_ds = BrainSlices(args.data, "train", args.cache, train=True)
    val_ds = BrainSlices(args.data, "val", args.cache, train=False)
    tr_sampler = DistributedSampler(train_ds)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, args.bs, sampler=tr_sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.bs, sampler=va_sampler, num_workers=8, pin_memory=True)

    model = DDP(UNet().to(dev), device_ids=[lr_])
    ssim = SSIM().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    tb = SummaryWriter(args.out) if rank == 0 else None

    gstep = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        for x, y, mv in train_loader:
            x, y, mv = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True), mv.to(dev).float()
            out = model(x)
            loss = args.alpha * (1 - ssim(out, y, mv)).mean() + (1 - args.alpha) * F.l1_loss(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            gstep += 1
            if tb is not None and gstep % 100 == 0:
                tb.add_scalar("train/loss", loss.item(), gstep)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], gstep)

        model.eval()
        acc = torch.zeros(3, device=dev)
        with torch.no_grad():
            for x, y, mv in val_loader:
                x, y, mv = x.to(dev), y.to(dev), mv.to(dev).float()
                out = model.module(x)
                acc[0] += ssim(out, y, mv).sum()
                acc[1] += F.l1_loss(out, y, reduction="none").mean(dim=(1, 2, 3)).sum()
                acc[2] += x.shape[0]
        dist.all_reduce(acc)
        if rank == 0:
            v_ssim, v_l1 = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
            tb.add_scalar("val/ssim", v_ssim, epoch)
            tb.add_scalar("val/l1", v_l1, epoch)
            print(f"epoch {epoch} val SSIM {v_ssim:.4f} L1 {v_l1:.5f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.out, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
