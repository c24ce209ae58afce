#!/usr/bin/env python
"""
2D Noise2Noise denoiser for cryo-ET tilt series (even/odd frame halves per
tilt), evaluated per tilt image with PSNR against the full-dose average.

Inputs per tilt series (from the Warp/IMOD preprocessing):
    <ts>_even.mrc, <ts>_odd.mrc, <ts>_full.mrc   (n_tilts, Y, X)

Per-tilt PSNRs are collected from all GPUs so we can report the median and
the worst tilts (high tilts are the interesting ones).

    torchrun --nproc_per_node=4 16_cryoet_tilt_n2n.py --data /data/cryoet/ts_halves \
        --val-series TS_43 TS_44 --out runs/ts_n2n
"""
import argparse
import glob
import json
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def opts():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--val-series", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tile", type=int, default=384)
    ap.add_argument("--tiles-per-tilt", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def standardize(x):
    x = x.astype(np.float32)
    return (x - x.mean()) / (x.std() + 1e-6)


class TiltTiles(Dataset):
    def __init__(self, series, root, tile, per_tilt):
        self.items = []
        self.root, self.tile = root, tile
        for ts in series:
            with mrcfile.mmap(os.path.join(root, f"{ts}_even.mrc"), mode="r", permissive=True) as m:
                n = m.data.shape[0]
            self.items += [(ts, k) for k in range(n) for _ in range(per_tilt)]
        self._mm = {}

    def _arr(self, ts, half):
        key = (ts, half)
        if key not in self._mm:
            self._mm[key] = mrcfile.mmap(os.path.join(self.root, f"{ts}_{half}.mrc"), mode="r", permissive=True).data
        return self._mm[key]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ts, k = self.items[i]
        ev, od = self._arr(ts, "even"), self._arr(ts, "odd")
        _, H, W = ev.shape
        t = self.tile
        y, x = np.random.randint(0, H - t + 1), np.random.randint(0, W - t + 1)
        a, b = standardize(ev[k, y:y + t, x:x + t]), standardize(od[k, y:y + t, x:x + t])
        if np.random.rand() < 0.5:
            a, b = b, a
        return torch.from_numpy(a)[None], torch.from_numpy(b)[None]


class Denoiser(nn.Module):
    def __init__(self, c=48):
        super().__init__()
        blk = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.LeakyReLU(0.1, True),  # noqa
                                         nn.Conv2d(o, o, 3, padding=1), nn.LeakyReLU(0.1, True))
        self.e1, self.e2, self.e3 = blk(1, c), blk(c, c), blk(c, c)
        self.m = blk(c, c)
        self.d3, self.d2, self.d1 = blk(2 * c, c), blk(2 * c, c), blk(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        e1 = self.e1(x)
        e2 = self.e2(F.max_pool2d(e1, 2))
        e3 = self.e3(F.max_pool2d(e2, 2))
        m = self.m(F.max_pool2d(e3, 2))
        d = self.d3(torch.cat([F.interpolate(m, scale_factor=2), e3], 1))
        d = self.d2(torch.cat([F.interpolate(d, scale_factor=2), e2], 1))
        d = self.d1(torch.cat([F.interpolate(d, scale_factor=2), e1], 1))
        return self.out(d)


@torch.no_grad()
def tilt_psnrs(net, root, series, device, rank, world):
    """denoise whole tilt images; returns PSNR vs the full-dose sum for this rank's tilts"""
    jobs = [(ts, k) for ts in series
            for k in range(mrcfile.mmap(os.path.join(root, f"{ts}_even.mrc"), mode="r").data.shape[0])]
    mine = jobs[rank::world]
    vals = []
    for ts, k in mine:
        with mrcfile.mmap(os.path.join(root, f"{ts}_even.mrc"), mode="r") as m:
            ev = standardize(m.data[k])
        with mrcfile.mmap(os.path.join(root, f"{ts}_full.mrc"), mode="r") as m:
            ref = standardize(m.data[k])
        H, W = (ev.shape[0] // 8) * 8, (ev.shape[1] // 8) * 8
        den = net(torch.from_numpy(ev[:H, :W])[None, None].to(device))[0, 0]
        ref_t = torch.from_numpy(ref[:H, :W]).to(device)
        mse = F.mse_loss(den, ref_t)
        rng = ref_t.max() - ref_t.min()
        vals.append(10 * torch.log10(rng ** 2 / mse))
    return torch.stack(vals) if vals else torch.zeros(0, device=device)


def main():
    args = opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    all_series = sorted(os.path.basename(f)[:-len("_even.mrc")] for f in glob.glob(os.path.join(args.data, "*_even.mrc")))
    train_series = [s for s in all_series if s not in args.val_series]
    train_ds = TiltTiles(train_series, args.data, args.tile, args.tiles_per_tilt)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True)

    model = DDP(Denoiser().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    history = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for a, b in dl:
            a, b = a.to(device, non_blocking=True), b.to(device, non_blocking=True)
            loss = F.mse_loss(model(a), b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            model.eval()
            local = tilt_psnrs(model.module, args.data, args.val_series, device, rank, world)
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            psnr = torch.cat(gathered).cpu().numpy()
            if rank == 0:
                rec = {"epoch": epoch, "train_loss": (run[0] / run[1]).item(),
                       "psnr_median": float(np.median(psnr)), "psnr_p10": float(np.percentile(psnr, 10))}
                history.append(rec)
                print(json.dumps(rec), flush=True)
                with open(os.path.join(args.out, "history.json"), "w") as fh:
                    json.dump(history, fh, indent=1)
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"ts_n2n_e{epoch:03d}.pt"))
        elif rank == 0:
            print(f"epoch {epoch} train {(run[0] / run[1]).item():.5f} ({time.time() - t0:.0f}s)", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
