"""
Cross-domain cascade (k-space CNN -> image CNN, x2, with data consistency) on fastMRI single-coil knee.

Validation follows the fastMRI protocol: SSIM is computed per volume (not per slice), so a
volume-level sampler hands whole volumes to each rank, and the per-slice SSIM values are
gathered on every rank before aggregating them per volume.

    torchrun --standalone --nproc_per_node=8 18_kiki_knee_volume_eval.py --root /data/knee --accel 4
"""
import argparse
import os
import time
import zlib
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


def fft2c(x):
    return torch.fft.fftshift(torch.fft.fft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def ifft2c(x):
    return torch.fft.fftshift(torch.fft.ifft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def c2r(z):
    return torch.stack([z.real, z.imag], 1)


def r2c(x):
    return torch.complex(x[:, 0], x[:, 1])


class SliceData(Dataset):
    def __init__(self, folder, accel, cf, val=False):
        self.samples = []
        self.vol_ids = []
        for vid, f in enumerate(sorted(Path(folder).glob("*.h5"))):
            with h5py.File(f, "r") as hf:
                n = hf["kspace"].shape[0]
            self.samples += [(f, s) for s in range(n)]
            self.vol_ids += [vid] * n
        self.accel, self.cf, self.val = accel, cf, val

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        f, s = self.samples[i]
        with h5py.File(f, "r") as hf:
            k = torch.from_numpy(hf["kspace"][s])
            tgt = torch.from_numpy(hf["reconstruction_esc"][s])
            mx = float(hf.attrs["max"])
        w = k.shape[-1]
        seed = zlib.crc32(f.name.encode()) if self.val else None
        rng = np.random.default_rng(seed)
        nl = int(round(w * self.cf))
        m = rng.uniform(size=w) < (w / self.accel - nl) / (w - nl)
        m[(w - nl + 1) // 2:(w - nl + 1) // 2 + nl] = True
        m = torch.from_numpy(m.astype(np.float32))[None].expand_as(k.real).contiguous()
        scale = ifft2c(k * m).abs().max()
        return k * m / scale, m, tgt / scale, mx / scale.item(), self.vol_ids[i]


class VolumeSampler(Sampler):
    """Whole volumes per rank (volumes strided over ranks), slice order kept."""

    def __init__(self, vol_ids, rank, world):
        vols = sorted(set(vol_ids))[rank::world]
        keep = set(vols)
        self.indices = [i for i, v in enumerate(vol_ids) if v in keep]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def cnn(ch=64, n=5):
    layers = [nn.Conv2d(2, ch, 3, padding=1), nn.LeakyReLU(0.1, True)]
    for _ in range(n - 2):
        layers += [nn.Conv2d(ch, ch, 3, padding=1), nn.LeakyReLU(0.1, True)]
    return nn.Sequential(*layers, nn.Conv2d(ch, 2, 3, padding=1))


class KIKI(nn.Module):
    def __init__(self, iters=2):
        super().__init__()
        self.k_nets = nn.ModuleList([cnn() for _ in range(iters)])
        self.i_nets = nn.ModuleList([cnn() for _ in range(iters)])

    def forward(self, k0, m):
        k = k0
        for kn, im in zip(self.k_nets, self.i_nets):
            k = r2c(c2r(k) + kn(c2r(k)))
            x = ifft2c(k)
            x = r2c(c2r(x) + im(c2r(x)))
            k = fft2c(x)
            k = m * k0 + (1 - m) * k
        return ifft2c(k)


def center_crop(x, h, w):
    H, W = x.shape[-2:]
    return x[..., (H - h) // 2:(H - h) // 2 + h, (W - w) // 2:(W - w) // 2 + w]


def ssim_per_slice(x, y, dr, win=7):
    x, y = x[:, None], y[:, None]
    k = torch.ones(1, 1, win, win, device=x.device) / win ** 2
    c1, c2 = (0.01 * dr) ** 2, (0.03 * dr) ** 2
    ux, uy = F.conv2d(x, k), F.conv2d(y, k)
    vx, vy, vxy = F.conv2d(x * x, k) - ux ** 2, F.conv2d(y * y, k) - uy ** 2, F.conv2d(x * y, k) - ux * uy
    s = (2 * ux * uy + c1) * (2 * vxy + c2) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
    return s.flatten(1).mean(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--accel", type=int, default=4)
    ap.add_argument("--cf", type=float, default=0.08)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", type=Path, default=Path("ckpt/kiki"))
    args = ap.parse_args()

    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lr_)

    tr = SliceData(args.root / "singlecoil_train", args.accel, args.cf)
    va = SliceData(args.root / "singlecoil_val", args.accel, args.cf, val=True)
    ts = DistributedSampler(tr, shuffle=True, drop_last=True)
    tl = DataLoader(tr, args.bs, sampler=ts, num_workers=8, pin_memory=True, drop_last=True)
    vl = DataLoader(va, 1, sampler=VolumeSampler(va.vol_ids, rank, world), num_workers=4)

    model = DDP(KIKI().to(dev), device_ids=[lr_])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.95)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        ts.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (k, m, tgt, _, _) in enumerate(tl):
            k, m, tgt = k.to(dev), m.to(dev), tgt.to(dev)
            rec = center_crop(model(k, m).abs(), *tgt.shape[-2:])
            loss = F.l1_loss(rec, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        model.eval()
        ssims, vids = [], []
        with torch.no_grad():
            for k, m, tgt, mx, vid in vl:
                k, m, tgt = k.to(dev), m.to(dev), tgt.to(dev)
                rec = center_crop(model.module(k, m).abs(), *tgt.shape[-2:])
                ssims.append(ssim_per_slice(rec, tgt, mx.to(dev).float().view(-1, 1, 1, 1)))
                vids.append(vid.to(dev))
        ssims, vids = torch.cat(ssims), torch.cat(vids)

        all_ssim = [torch.empty_like(ssims) for _ in range(world)]
        all_vid = [torch.empty_like(vids) for _ in range(world)]
        dist.all_gather(all_ssim, ssims)
        dist.all_gather(all_vid, vids)
        all_ssim, all_vid = torch.cat(all_ssim), torch.cat(all_vid)
        per_vol = [all_ssim[all_vid == v].mean() for v in torch.unique(all_vid)]
        val_ssim = torch.stack(per_vol).mean().item()

        if rank == 0:
            print(f"epoch {epoch} val SSIM {val_ssim:.4f} over {len(per_vol)} volumes ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       args.out / "last.pt")
            if val_ssim > best:
                best = val_ssim
                torch.save(model.module.state_dict(), args.out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
