"""CARE-style content-aware restoration of low-laser-power confocal stacks.

Pairs of (low SNR, high SNR) 3D stacks of the same field of view are in <data>/low and
<data>/high (TIFF, ZYX).  After training, rank 0 restores the test stacks with the best
model and writes them next to the run folder.

    torchrun --nproc_per_node=4 15_care_restoration_export.py --data /lab/imaging/care_tribolium --out runs/care_trib
"""
import argparse
import glob
import os
import time

import numpy as np
import tifffile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--patch", type=int, nargs=3, default=[16, 64, 64])
    p.add_argument("--patches-per-stack", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tile", type=int, nargs=3, default=[32, 256, 256])
    return p.parse_args()


def percentile_norm(x, lo=2.0, hi=99.8):
    a, b = np.percentile(x, [lo, hi])
    return ((x - a) / (b - a + 1e-6)).astype(np.float32)


class PairedPatches(Dataset):
    def __init__(self, low_files, high_files, patch, per_stack):
        self.pairs = [(percentile_norm(tifffile.imread(l)), percentile_norm(tifffile.imread(h)))
                      for l, h in zip(low_files, high_files)]
        self.patch, self.per_stack = patch, per_stack
        # sample patch origins once, biased towards bright (foreground) regions
        rng = np.random.default_rng(0)
        self.origins = []
        for s, (_, high) in enumerate(self.pairs):
            thr = np.percentile(high, 90)
            tries = 0
            while sum(1 for o in self.origins if o[0] == s) < per_stack and tries < 50 * per_stack:
                o = [int(rng.integers(0, d - p + 1)) for d, p in zip(high.shape, patch)]
                sl = tuple(slice(a, a + p) for a, p in zip(o, patch))
                tries += 1
                if high[sl].max() > thr:
                    self.origins.append((s, *o))

    def __len__(self):
        return len(self.origins)

    def __getitem__(self, i):
        s, z, y, x = self.origins[i]
        pz, py, px = self.patch
        low, high = self.pairs[s]
        a = low[z:z + pz, y:y + py, x:x + px]
        b = high[z:z + pz, y:y + py, x:x + px]
        k = np.random.randint(4)
        a, b = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2))
        return torch.from_numpy(a.copy())[None], torch.from_numpy(b.copy())[None]


class CAREUNet(nn.Module):
    def __init__(self, n_first=32, depth=2):
        super().__init__()
        ch = [n_first * 2 ** i for i in range(depth + 1)]

        def conv2(i, o):
            return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.ReLU(inplace=True),
                                 nn.Conv3d(o, o, 3, padding=1), nn.ReLU(inplace=True))

        self.enc = nn.ModuleList([conv2(1 if i == 0 else ch[i - 1], ch[i]) for i in range(depth + 1)])
        self.dec = nn.ModuleList([conv2(ch[i + 1] + ch[i], ch[i]) for i in reversed(range(depth))])
        self.out = nn.Conv3d(ch[0], 1, 1)

    def forward(self, x):
        inp, skips = x, []
        for i, e in enumerate(self.enc):
            x = e(x if i == 0 else F.max_pool3d(x, (1, 2, 2)))
            skips.append(x)
        x = skips.pop()
        for d in self.dec:
            s = skips.pop()
            x = d(torch.cat([F.interpolate(x, size=s.shape[2:], mode="nearest"), s], 1))
        return inp + self.out(x)  # residual, as in CSBDeep


@torch.no_grad()
def restore_stack(net, stack, tile, device, margin=(4, 16, 16)):
    """Tiled prediction with overlapping margins that are cropped away."""
    shape = stack.shape
    out = np.zeros_like(stack)
    tiles = [min(t, s) for t, s in zip(tile, shape)]

    def axis_plan(n, t, m):
        # (write start, write end, read start) along one axis
        if n <= t:
            return [(0, n, 0)]
        step = t - 2 * m
        plan = []
        for a in range(0, n, step):
            r0 = min(max(a - m, 0), n - t)
            plan.append((a, min(a + step, n), r0))
        return plan

    plans = [axis_plan(n, t, m) for n, t, m in zip(shape, tiles, margin)]
    tz, ty, tx = tiles
    for z, ze, z0 in plans[0]:
        for y, ye, y0 in plans[1]:
            for x, xe, x0 in plans[2]:
                t = torch.from_numpy(stack[z0:z0 + tz, y0:y0 + ty, x0:x0 + tx].copy())[None, None].to(device)
                pred = net(t)[0, 0].cpu().numpy()
                out[z:ze, y:ye, x:xe] = pred[z - z0:ze - z0, y - y0:ye - y0, x - x0:xe - x0]
    return out


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    low = sorted(glob.glob(os.path.join(args.data, "train", "low", "*.tif")))
    high = sorted(glob.glob(os.path.join(args.data, "train", "high", "*.tif")))
    n_val = max(1, len(low) // 10)
    train_ds = PairedPatches(low[n_val:], high[n_val:], args.patch, args.patches_per_stack)
    val_ds = PairedPatches(low[:n_val], high[:n_val], args.patch, 64)
    sampler = DistributedSampler(train_ds, shuffle=True)
    dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.batch_size, num_workers=2)

    model = DDP(CAREUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=10, min_lr=1e-6)

    os.makedirs(args.out, exist_ok=True)
    ckpt_last = os.path.join(args.out, "weights_last.pt")
    ckpt_best = os.path.join(args.out, "weights_best.pt")
    start, best = 0, float("inf")
    if args.resume and os.path.exists(ckpt_last):
        ck = torch.load(ckpt_last, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for a, b in dl:
            a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
            loss = F.l1_loss(model(a), b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        v = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, b in val_dl:
                a, b = a.to(device), b.to(device)
                v += torch.stack([F.l1_loss(model(a), b, reduction="sum"), torch.tensor(float(b.numel()), device=device)])
        dist.all_reduce(v)
        val_mae = (v[0] / v[1]).item()
        sched.step(val_mae)

        if rank == 0:
            print(f"epoch {epoch:3d} val MAE {val_mae:.5f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": min(best, val_mae)}
            torch.save(state, ckpt_last)
            if val_mae < best:
                torch.save(state, ckpt_best)
        best = min(best, val_mae)
        dist.barrier()

    # restore the test stacks with the best weights (single GPU is enough)
    if rank == 0:
        net = CAREUNet().to(device).eval()
        net.load_state_dict(torch.load(ckpt_best, map_location=device)["model"])
        test_dir = os.path.join(args.out, "restored")
        os.makedirs(test_dir, exist_ok=True)
        for f in sorted(glob.glob(os.path.join(args.data, "test", "low", "*.tif"))):
            x = percentile_norm(tifffile.imread(f))
            y = restore_stack(net, x, args.tile, device)
            tifffile.imwrite(os.path.join(test_dir, os.path.basename(f)), y.astype(np.float32),
                             imagej=True, metadata={"axes": "ZYX"})
            print(f"restored {os.path.basename(f)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
