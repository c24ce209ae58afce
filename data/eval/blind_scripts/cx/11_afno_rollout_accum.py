"""AFNO/ViT hybrid fine-tuned on 4-step (24 h) autoregressive rollouts at 0.25 deg.

* activation checkpointing inside every rollout step (non-reentrant)
* gradient accumulation over `--accum` micro-batches (all-reduce only on the last)
* a block-shuffled time-window sampler: training windows are drawn in blocks of
  consecutive days (fewer zarr chunk reads), blocks shuffled every epoch
* validation: latitude-weighted RMSE and ACC over all of 2018, 00/12 UTC inits

    torchrun --standalone --nproc_per_node=8 11_afno_rollout_accum.py --init /nvme_shared/afno/1step.pt
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

CH = ["u10", "v10", "t2m", "sp", "msl", "t850", "u1000", "v1000", "z1000", "u850", "v850", "z850",
      "u500", "v500", "z500", "t500", "z50", "r500", "r850", "tcwv"]


class Windows(Dataset):
    def __init__(self, zarr, years, steps, stats):
        ds = xr.open_zarr(zarr)
        ds = ds.sel(time=ds.time.dt.year.isin(list(years)))
        self.a = ds["fields"].sel(channel=CH).isel(lat=slice(0, 720))
        self.mu = stats["mean"][:, None, None].astype(np.float32)
        self.sd = stats["std"][:, None, None].astype(np.float32)
        self.steps = steps

    def __len__(self):
        return self.a.sizes["time"] - self.steps

    def __getitem__(self, i):
        w = self.a.isel(time=slice(i, i + self.steps + 1)).values.astype(np.float32)
        return torch.from_numpy((w - self.mu) / self.sd)


class BlockShuffleSampler(Sampler):
    """Distributed sampler over blocks of `block` consecutive indices.

    Blocks are shuffled with a generator seeded by (seed, epoch), identical on every rank,
    truncated to a multiple of world_size and dealt out round-robin, so every rank gets
    the same number of blocks and the ranks never overlap.
    """

    def __init__(self, n, block, rank, world, seed=0):
        self.n, self.block, self.rank, self.world, self.seed = n, block, rank, world, seed
        self.n_blocks = (n // block) // world * world
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n // self.block, generator=g)[: self.n_blocks]
        mine = order[self.rank:: self.world]
        for b in mine.tolist():
            yield from range(b * self.block, (b + 1) * self.block)

    def __len__(self):
        return self.n_blocks // self.world * self.block


class Mixer(nn.Module):
    def __init__(self, dim, blocks=8):
        super().__init__()
        self.nb, self.bs = blocks, dim // blocks
        self.w = nn.Parameter(0.02 * torch.randn(2, blocks, self.bs, self.bs))

    def forward(self, x):  # B, H, W, C
        B, H, W, C = x.shape
        with torch.autocast("cuda", enabled=False):
            f = torch.fft.rfft2(x.float(), dim=(1, 2), norm="ortho").reshape(B, H, W // 2 + 1, self.nb, self.bs)
            wr, wi = self.w[0], self.w[1]
            re = torch.einsum("...bi,bio->...bo", f.real, wr) - torch.einsum("...bi,bio->...bo", f.imag, wi)
            im = torch.einsum("...bi,bio->...bo", f.imag, wr) + torch.einsum("...bi,bio->...bo", f.real, wi)
            f = torch.complex(F.softshrink(re, 0.01), F.softshrink(im, 0.01)).reshape(B, H, W // 2 + 1, C)
            out = torch.fft.irfft2(f, s=(H, W), dim=(1, 2), norm="ortho")
        return out.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.n1, self.mix = nn.LayerNorm(dim), Mixer(dim)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.mix(self.n1(x))
        return x + self.mlp(self.n2(x))


class Net(nn.Module):
    def __init__(self, ch, patch=8, dim=768, depth=12, ckpt=True):
        super().__init__()
        self.p, self.ch, self.ckpt = patch, ch, ckpt
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, 90, 180, dim))
        self.layers = nn.ModuleList([Layer(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, ch * patch * patch)

    def step(self, x):
        B = x.shape[0]
        h = self.embed(x).permute(0, 2, 3, 1) + self.pos
        for layer in self.layers:
            h = layer(h)
        h = self.head(h).view(B, 90, 180, self.p, self.p, self.ch)
        return x + h.permute(0, 5, 1, 3, 2, 4).reshape(B, self.ch, 720, 1440)

    def forward(self, x, steps):
        outs = []
        for _ in range(steps):
            if self.ckpt and self.training:
                x = checkpoint(self.step, x, use_reentrant=False)
            else:
                x = self.step(x)
            outs.append(x)
        return torch.stack(outs, 1)

    @torch.no_grad()
    def rollout(self, x, steps):
        return self.forward(x, steps)


def lat_weights(device):
    lat = torch.linspace(90, -89.75, 720, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, 1, -1, 1)


@torch.no_grad()
def validate(net, loader, w, clim, steps, device):
    net.eval()
    tot = torch.zeros(3, steps, len(CH), device=device, dtype=torch.float64)
    for win in loader:
        win = win.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net.rollout(win[:, 0], steps).float()
        truth = win[:, 1:]
        pa, ta = pred - clim, truth - clim
        acc = (w * pa * ta).sum((-2, -1)) / torch.sqrt((w * pa ** 2).sum((-2, -1)) * (w * ta ** 2).sum((-2, -1)))
        tot[0] += (w * (pred - truth) ** 2).mean((-2, -1)).sum(0).double()
        tot[1] += acc.sum(0).double()
        tot[2] += win.shape[0]
    dist.all_reduce(tot)
    return (tot[0] / tot[2]).sqrt(), tot[1] / tot[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/nvme_shared/era5/fcn_0p25_6h.zarr")
    ap.add_argument("--stats", default="/nvme_shared/era5/fcn_stats_1979_2015.npz")
    ap.add_argument("--clim", default="/nvme_shared/era5/fcn_clim_norm.npy")
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", default="/nvme_shared/afno/rollout4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--eval_steps", type=int, default=20)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    stats = np.load(args.stats)
    train_ds = Windows(args.zarr, range(1979, 2016), args.steps, stats)
    val_ds = Windows(args.zarr, [2018], args.eval_steps, stats)
    val_ds = Subset(val_ds, list(range(0, len(val_ds), 2))[rank::world])
    sampler = BlockShuffleSampler(len(train_ds), block=4, rank=rank, world=world, seed=42)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=8, pin_memory=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, num_workers=4)

    net = Net(len(CH)).to(dev)
    net.load_state_dict(torch.load(args.init, map_location="cpu")["model"])
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    updates = args.epochs * math.ceil(len(train_dl) / args.accum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=updates)
    w = lat_weights(dev)
    clim = torch.as_tensor(np.load(args.clim)[:, :720], dtype=torch.float32, device=dev)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        n_batches = len(train_dl)
        for it, win in enumerate(train_dl):
            win = win.to(dev, non_blocking=True)
            last_micro = (it + 1) % args.accum == 0 or it + 1 == n_batches
            ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(win[:, 0], args.steps)
                loss = (w * (pred.float() - win[:, 1:]) ** 2).mean() / args.accum
                loss.backward()
            if last_micro:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{n_batches} loss {loss.item() * args.accum:.5f}", flush=True)

        rmse, acc = validate(model.module, val_dl, w, clim, args.eval_steps, dev)
        if rank == 0:
            zi = CH.index("z500")
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) z500 RMSE d5 {rmse[19, zi]:.4f} ACC d5 {acc[19, zi]:.3f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"ep{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
