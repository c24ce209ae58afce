"""Noise2Void self-supervised denoising of large 3D fluorescence volumes (lattice light-sheet).

The (cropped, normalised) volume is uploaded to the GPU once, and blind-spot patches are
cut and masked directly on the device, which is much faster than cutting them from a
memory-mapped TIFF on the host.

    torchrun --nproc_per_node=4 16_n2v_gpu_resident_volume.py --stack /data/llsm/2023-11-02/cell3_ch0.tif --out runs/n2v_cell3
"""
import argparse
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--stack", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--patch", type=int, nargs=3, default=[32, 64, 64])
    p.add_argument("--n-patches", type=int, default=16384)
    p.add_argument("--mask-frac", type=float, default=0.002)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--val-z", type=int, default=32, help="last z slices held out for validation")
    return p.parse_args()


class BlindSpotPatches(Dataset):
    def __init__(self, volume, patch, n, mask_frac, device, deterministic=False):
        # whole stack lives on the GPU; patches are cut by indexing
        self.vol = torch.from_numpy(volume).to(device)
        self.patch, self.n, self.mask_frac = patch, n, mask_frac
        self.deterministic = deterministic

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        g = torch.Generator(device=self.vol.device)
        if self.deterministic:
            g.manual_seed(idx)
        else:
            g.seed()
        pz, py, px = self.patch
        Z, Y, X = self.vol.shape
        z = int(torch.randint(0, Z - pz + 1, (1,), generator=g, device=self.vol.device))
        y = int(torch.randint(0, Y - py + 1, (1,), generator=g, device=self.vol.device))
        x = int(torch.randint(0, X - px + 1, (1,), generator=g, device=self.vol.device))
        target = self.vol[z:z + pz, y:y + py, x:x + px]
        n_mask = max(1, int(self.mask_frac * target.numel()))
        flat = torch.randint(0, target.numel(), (n_mask,), generator=g, device=self.vol.device)
        # replace each masked voxel by a random neighbour within a 5x5x5 window (N2V uniform_withCP)
        zz, yy, xx = np.unravel_index(flat.cpu().numpy(), target.shape)
        off = torch.randint(-2, 3, (3, n_mask), generator=g, device=self.vol.device).cpu().numpy()
        nz = np.clip(zz + off[0], 0, pz - 1)
        ny = np.clip(yy + off[1], 0, py - 1)
        nx = np.clip(xx + off[2], 0, px - 1)
        inp = target.clone()
        inp[zz, yy, xx] = target[nz, ny, nx]
        mask = torch.zeros_like(target)
        mask[zz, yy, xx] = 1.0
        return inp[None], target[None], mask[None]


def conv_bn(i, o):
    return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.ReLU(inplace=True))


class N2VUNet(nn.Module):
    def __init__(self, f=32):
        super().__init__()
        self.e1 = nn.Sequential(conv_bn(1, f), conv_bn(f, f))
        self.e2 = nn.Sequential(conv_bn(f, 2 * f), conv_bn(2 * f, 2 * f))
        self.b = nn.Sequential(conv_bn(2 * f, 4 * f), conv_bn(4 * f, 4 * f))
        self.d2 = nn.Sequential(conv_bn(6 * f, 2 * f), conv_bn(2 * f, 2 * f))
        self.d1 = nn.Sequential(conv_bn(3 * f, f), conv_bn(f, f))
        self.out = nn.Conv3d(f, 1, 1)

    def forward(self, x):
        a = self.e1(x)
        b = self.e2(F.max_pool3d(a, 2))
        c = self.b(F.max_pool3d(b, 2))
        y = self.d2(torch.cat([F.interpolate(c, scale_factor=2.0, mode="trilinear"), b], 1))
        y = self.d1(torch.cat([F.interpolate(y, scale_factor=2.0, mode="trilinear"), a], 1))
        return x + self.out(y)


def masked_mse(pred, target, mask):
    return ((pred - target) ** 2 * mask).sum() / mask.sum().clamp(min=1)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    vol = tifffile.imread(args.stack).astype(np.float32)
    mean, std = float(vol.mean()), float(vol.std())
    vol = (vol - mean) / std
    train_vol, val_vol = vol[:-args.val_z], vol[-args.val_z:]

    train_ds = BlindSpotPatches(train_vol, args.patch, args.n_patches, args.mask_frac, device)
    val_ds = BlindSpotPatches(val_vol, args.patch, 256 * world, args.mask_frac, device, deterministic=True)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                          num_workers=args.workers, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size,
                        sampler=DistributedSampler(val_ds, shuffle=False), num_workers=0)

    model = DDP(N2VUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=10)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"volume {vol.shape}, {world} GPUs, {len(train_dl)} steps/epoch", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for inp, tgt, mask in train_dl:
            loss = masked_mse(model(inp), tgt, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for inp, tgt, mask in val_dl:
                pred = model.module(inp)
                acc[0] += ((pred - tgt) ** 2 * mask).sum()
                acc[1] += mask.sum()
        dist.all_reduce(acc)
        val = (acc[0] / acc[1]).item()
        sched.step(val)

        if rank == 0:
            print(f"epoch {epoch:3d} val masked MSE {val:.5f} lr {opt.param_groups[0]['lr']:.1e} "
                  f"({time.time() - t0:.1f}s)", flush=True)
            ck = {"model": model.module.state_dict(), "epoch": epoch, "mean": mean, "std": std}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if val < best:
                best = val
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
