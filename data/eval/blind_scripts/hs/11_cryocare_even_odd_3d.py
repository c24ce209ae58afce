"""cryoCARE-style 3D denoising of tomograms from even/odd frame reconstructions.

Every step runs the network on the even AND on the odd sub-volume (two forward passes
through the DDP model, one backward on the symmetric loss).  The network uses GroupNorm
only, so there are no running buffers for DDP to synchronise between the two passes.
Encoder blocks are wrapped in non-reentrant activation checkpointing so that 96^3
patches with batch 4 fit on a 24 GB card.

    torchrun --nproc_per_node=4 11_cryocare_even_odd_3d.py --even tomo_even/*.mrc --odd tomo_odd/*.mrc \
        --out /scratch/$USER/cryocare/run3
"""
import argparse
import glob
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--even", nargs="+", required=True)
    ap.add_argument("--odd", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--patch", type=int, default=96)
    ap.add_argument("--n-patches", type=int, default=12000, help="patches per epoch, all GPUs")
    ap.add_argument("--val-frac", type=float, default=0.1, help="fraction of z held out")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def expand(patterns):
    return sorted(f for p in patterns for f in glob.glob(p))


class EvenOddPatches(Dataset):
    """Random patches from a z-range of each even/odd tomogram pair.

    The sample position is derived from (seed, epoch, index), so the DistributedSampler's
    index split decides which patches each rank sees."""

    def __init__(self, evens, odds, patch, n, zfrac, seed):
        self.pairs = []
        for e, o in zip(evens, odds):
            with mrcfile.open(e, permissive=True) as m:
                ve = m.data.astype(np.float32)
            with mrcfile.open(o, permissive=True) as m:
                vo = m.data.astype(np.float32)
            mu = 0.5 * (ve.mean() + vo.mean())
            sd = 0.5 * (ve.std() + vo.std()) + 1e-6
            z0, z1 = int(zfrac[0] * ve.shape[0]), int(zfrac[1] * ve.shape[0])
            self.pairs.append(((ve[z0:z1] - mu) / sd, (vo[z0:z1] - mu) / sd))
        self.patch, self.n, self.seed, self.epoch = patch, n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        rng = np.random.default_rng([self.seed, self.epoch, idx])
        ve, vo = self.pairs[rng.integers(len(self.pairs))]
        p = self.patch
        z, y, x = (rng.integers(0, s - p + 1) for s in ve.shape)
        a = ve[z:z + p, y:y + p, x:x + p]
        b = vo[z:z + p, y:y + p, x:x + p]
        k = rng.integers(4)
        a, b = np.rot90(a, k, (1, 2)), np.rot90(b, k, (1, 2))
        if rng.random() < 0.5:
            a, b = b, a
        return torch.from_numpy(a.copy())[None], torch.from_numpy(b.copy())[None]


class Block(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.net = nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.LeakyReLU(0.1),
                                 nn.Conv3d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.LeakyReLU(0.1))

    def forward(self, x):
        return self.net(x)


class CareUNet(nn.Module):
    def __init__(self, f=32, depth=3, grad_ckpt=False):
        super().__init__()
        chs = [f * 2 ** i for i in range(depth + 1)]
        self.grad_ckpt = grad_ckpt
        self.inp = nn.Conv3d(1, f, 3, padding=1)
        self.enc = nn.ModuleList([Block(chs[i - 1] if i else f, chs[i]) for i in range(depth + 1)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(chs[i + 1], chs[i], 2, 2) for i in reversed(range(depth))])
        self.dec = nn.ModuleList([Block(2 * chs[i], chs[i]) for i in reversed(range(depth))])
        self.out = nn.Conv3d(f, 1, 1)

    def _run(self, blk, x):
        if self.grad_ckpt and self.training:
            return checkpoint(blk, x, use_reentrant=False)
        return blk(x)

    def forward(self, x):
        inp = x
        x = self.inp(x)
        skips = []
        for i, blk in enumerate(self.enc):
            if i:
                x = F.max_pool3d(x, 2)
            x = self._run(blk, x)
            skips.append(x)
        skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        return inp + self.out(x)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    evens, odds = expand(args.even), expand(args.odd)
    assert len(evens) == len(odds) and evens, "need matching even/odd tomograms"
    vf = args.val_frac
    train_ds = EvenOddPatches(evens, odds, args.patch, args.n_patches, (0.0, 1.0 - vf), args.seed)
    val_ds = EvenOddPatches(evens, odds, args.patch, 128 * world, (1.0 - vf, 1.0), args.seed + 1)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=2)

    model = CareUNet(grad_ckpt=args.grad_ckpt).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=10)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        train_ds.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=dev)
        for even, odd in train_dl:
            even, odd = even.to(dev, non_blocking=True), odd.to(dev, non_blocking=True)
            loss = 0.5 * (F.mse_loss(model(even), odd) + F.mse_loss(model(odd), even))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones_like(loss)])

        model.eval()
        val = torch.zeros(2, device=dev)
        with torch.no_grad():
            for even, odd in val_dl:
                even, odd = even.to(dev), odd.to(dev)
                val += torch.stack([F.mse_loss(model(even), odd), torch.ones((), device=dev)])
        dist.all_reduce(run)
        dist.all_reduce(val)
        tl, vl = (run[0] / run[1]).item(), (val[0] / val[1]).item()
        sched.step(vl)

        if rank == 0:
            writer.add_scalar("loss/train", tl, epoch)
            writer.add_scalar("loss/val", vl, epoch)
            writer.add_scalar("lr", opt.param_groups[0]["lr"], epoch)
            print(f"epoch {epoch:3d} train {tl:.5f} val {vl:.5f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
