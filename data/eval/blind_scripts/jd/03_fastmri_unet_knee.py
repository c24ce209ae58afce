"""
U-Net baseline for fastMRI single-coil knee, 4x / 8x random Cartesian masks.

Input: zero-filled magnitude image (center crop 320x320, instance-normalised)
Target: reconstruction_esc, normalised with the same mean/std.

Usage:
    torchrun --standalone --nproc_per_node=4 03_fastmri_unet_knee.py \
        --data-root /datasets/fastmri/knee --accel 4 8 --center-frac 0.08 0.04
"""
import argparse
import logging
import os
import pathlib
import zlib
from collections import defaultdict

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("unet_knee")


# ---------------------------------------------------------------- k-space helpers
def fft2c(x):
    return torch.fft.fftshift(torch.fft.fft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def ifft2c(k):
    return torch.fft.fftshift(torch.fft.ifft2(torch.fft.ifftshift(k, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def center_crop(x, shape):
    h, w = x.shape[-2:]
    top, left = (h - shape[0]) // 2, (w - shape[1]) // 2
    return x[..., top:top + shape[0], left:left + shape[1]]


class RandomMask:
    def __init__(self, center_fractions, accelerations):
        self.cf = center_fractions
        self.acc = accelerations

    def __call__(self, num_cols, rng):
        i = rng.integers(len(self.acc))
        cf, acc = self.cf[i], self.acc[i]
        num_low = int(round(num_cols * cf))
        prob = (num_cols / acc - num_low) / (num_cols - num_low)
        mask = rng.uniform(size=num_cols) < prob
        pad = (num_cols - num_low + 1) // 2
        mask[pad:pad + num_low] = True
        return torch.from_numpy(mask.astype(np.float32))


class KneeSlices(Dataset):
    def __init__(self, root, mask_func, crop=(320, 320), deterministic=False):
        self.files = sorted(pathlib.Path(root).glob("*.h5"))
        self.examples = []
        for f in self.files:
            with h5py.File(f, "r") as hf:
                n = hf["kspace"].shape[0]
            self.examples += [(f, s) for s in range(n)]
        self.mask_func = mask_func
        self.crop = crop
        self.deterministic = deterministic

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        fname, sl = self.examples[idx]
        with h5py.File(fname, "r") as hf:
            kspace = torch.from_numpy(hf["kspace"][sl])
            target = torch.from_numpy(hf["reconstruction_esc"][sl])
            max_val = float(hf.attrs["max"])
        seed = (zlib.crc32(fname.name.encode()) + sl) % 2 ** 32 if self.deterministic else None
        rng = np.random.default_rng(seed)
        mask = self.mask_func(kspace.shape[-1], rng)
        masked = kspace * mask[None, :]
        image = center_crop(ifft2c(masked).abs(), self.crop)
        mean, std = image.mean(), image.std() + 1e-11
        image = ((image - mean) / std).clamp(-6, 6)
        target = ((target - mean) / std).clamp(-6, 6)
        return image[None], target[None], mean, std, max_val, fname.name, sl


# ---------------------------------------------------------------- model
class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout, drop):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.InstanceNorm2d(cout), nn.LeakyReLU(0.2, True),
            nn.Dropout2d(drop),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.InstanceNorm2d(cout), nn.LeakyReLU(0.2, True),
            nn.Dropout2d(drop),
        )


class UNet(nn.Module):
    def __init__(self, chans=32, pools=4, drop=0.0):
        super().__init__()
        self.down = nn.ModuleList([ConvBlock(1, chans, drop)])
        ch = chans
        for _ in range(pools - 1):
            self.down.append(ConvBlock(ch, ch * 2, drop))
            ch *= 2
        self.bottleneck = ConvBlock(ch, ch * 2, drop)
        self.up_t, self.up_c = nn.ModuleList(), nn.ModuleList()
        for _ in range(pools):
            self.up_t.append(nn.ConvTranspose2d(ch * 2, ch, 2, stride=2))
            self.up_c.append(ConvBlock(ch * 2, ch, drop))
            ch //= 2
        self.out = nn.Conv2d(chans, 1, 1)

    def forward(self, x):
        stack = []
        for layer in self.down:
            x = layer(x)
            stack.append(x)
            x = F.avg_pool2d(x, 2)
        x = self.bottleneck(x)
        for t, c in zip(self.up_t, self.up_c):
            x = c(torch.cat([t(x), stack.pop()], dim=1))
        return self.out(x)


# ---------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    recons, targets, maxvals = defaultdict(dict), defaultdict(dict), {}
    for image, target, mean, std, max_val, fnames, slices in loader:
        out = net(image.to(device)).squeeze(1).cpu()
        m, s = mean[:, None, None], std[:, None, None]
        out, target = out * s + m, target.squeeze(1) * s + m
        for i, (fn, sl) in enumerate(zip(fnames, slices.tolist())):
            recons[fn][sl] = out[i].numpy()
            targets[fn][sl] = target[i].numpy()
            maxvals[fn] = float(max_val[i])

    # volume-wise metrics, as in the fastMRI leaderboard
    ssim_sum, psnr_sum, n_vol = 0.0, 0.0, 0
    for fn in recons:
        order = sorted(recons[fn])
        rec = np.stack([recons[fn][k] for k in order])
        gt = np.stack([targets[fn][k] for k in order])
        ssim_sum += np.mean([structural_similarity(gt[k], rec[k], data_range=maxvals[fn]) for k in range(len(gt))])
        psnr_sum += peak_signal_noise_ratio(gt, rec, data_range=maxvals[fn])
        n_vol += 1

    totals = torch.tensor([ssim_sum, psnr_sum, n_vol], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


class VolumeShardSampler(torch.utils.data.Sampler):
    """Give each rank whole volumes so that volume metrics are computed on one rank."""

    def __init__(self, dataset, rank, world):
        vols = sorted({str(f) for f, _ in dataset.examples})
        mine = set(vols[rank::world])
        self.indices = [i for i, (f, _) in enumerate(dataset.examples) if str(f) in mine]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", type=pathlib.Path, required=True)
    p.add_argument("--accel", type=int, nargs="+", default=[4, 8])
    p.add_argument("--center-frac", type=float, nargs="+", default=[0.08, 0.04])
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chans", type=int, default=32)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/unet_knee"))
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    mask_func = RandomMask(args.center_frac, args.accel)
    train_ds = KneeSlices(args.data_root / "singlecoil_train", mask_func)
    val_ds = KneeSlices(args.data_root / "singlecoil_val", mask_func, deterministic=True)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, args.batch_size, sampler=VolumeShardSampler(val_ds, rank, world),
                            num_workers=8)

    model = DDP(UNet(args.chans).to(device), device_ids=[local_rank])
    opt = torch.optim.RMSprop(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.1)
    args.out.mkdir(parents=True, exist_ok=True)
    best_ssim = 0.0

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (image, target, *_) in enumerate(train_loader):
            image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = F.l1_loss(model(image), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if it % 200 == 0:
                log.info("epoch %d it %d/%d l1 %.4f", epoch, it, len(train_loader), loss.item())
        sched.step()

        ssim, psnr = evaluate(model.module, val_loader, device)
        log.info("epoch %d  val SSIM %.4f  PSNR %.2f", epoch, ssim, psnr)
        if rank == 0:
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "ssim": ssim}
            torch.save(ckpt, args.out / "last.pt")
            if ssim > best_ssim:
                best_ssim = ssim
                torch.save(ckpt, args.out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
