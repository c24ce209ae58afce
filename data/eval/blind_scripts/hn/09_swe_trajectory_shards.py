"""Streaming training of an FNO surrogate for the 2D shallow-water equations on
solver output written as many HDF5 shards (one per solver job).

Each shard holds a variable number of runs with their own number of saved steps
(adaptive output interval), e.g.

    shard_00017.h5:  /run_003/h [T, 128, 128], /run_003/hu, /run_003/hv, attrs: dt, g

Shards are streamed (no global index) with a shuffle buffer.

    torchrun --nnodes=1 --nproc_per_node=8 09_swe_trajectory_shards.py --shards '/data/swe/train/shard_*.h5'
"""
import argparse
import glob
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--val-shards", default="/data/swe/val/shard_*.h5")
    p.add_argument("--out", default="runs/swe_fno")
    p.add_argument("--history", type=int, default=4)
    p.add_argument("--unroll", type=int, default=4)
    p.add_argument("--modes", type=int, default=20)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--buffer", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class ShardStream(IterableDataset):
    """Yields (history, future) windows; files are split over ranks, then over workers."""

    def __init__(self, files, history, unroll, buffer_size, rank, world, seed=0):
        self.files, self.history, self.unroll = files, history, unroll
        self.buffer_size, self.rank, self.world, self.seed = buffer_size, rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _my_files(self):
        files = self.files[self.rank::self.world]
        wi = get_worker_info()
        if wi is not None:
            files = files[wi.id::wi.num_workers]
        return files

    def _windows(self, rng):
        files = self._my_files()
        rng.shuffle(files)
        span = self.history + self.unroll
        for path in files:
            with h5py.File(path, "r") as f:
                for run in f.keys():
                    g = f[run]
                    q = np.stack([g["h"][:], g["hu"][:], g["hv"][:]], axis=1).astype(np.float32)  # [T, 3, H, W]
                    for t in range(q.shape[0] - span + 1):
                        yield torch.from_numpy(q[t:t + self.history]), torch.from_numpy(q[t + self.history:t + span])

    def __iter__(self):
        wi = get_worker_info()
        rng = random.Random(self.seed + 1000 * self.epoch + 17 * self.rank + (wi.id if wi else 0))
        buf = []
        for item in self._windows(rng):
            if len(buf) < self.buffer_size:
                buf.append(item)
                continue
            j = rng.randrange(len(buf))
            yield buf[j]
            buf[j] = item
        rng.shuffle(buf)
        yield from buf


class SpectralConv2d(nn.Module):
    def __init__(self, c, modes):
        super().__init__()
        self.modes = modes
        self.w = nn.Parameter(torch.randn(2, c, c, modes, modes, dtype=torch.cfloat) / (c * c))

    def forward(self, x):
        m = self.modes
        xf = torch.fft.rfft2(x, norm="ortho")
        out = torch.zeros(x.shape[0], self.w.shape[2], x.shape[-2], x.shape[-1] // 2 + 1, dtype=xf.dtype, device=x.device)
        out[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[..., :m, :m], self.w[0])
        out[..., -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[..., -m:, :m], self.w[1])
        return torch.fft.irfft2(out, s=x.shape[-2:], norm="ortho")


class SWEFNO(nn.Module):
    def __init__(self, history, modes, width, layers=5):
        super().__init__()
        self.lift = nn.Conv2d(3 * history + 2, width, 1)
        self.spec = nn.ModuleList([SpectralConv2d(width, modes) for _ in range(layers)])
        self.lin = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(layers)])
        self.proj = nn.Sequential(nn.Conv2d(width, 128, 1), nn.GELU(), nn.Conv2d(128, 3, 1))

    def forward(self, hist):
        b, th, c, H, W = hist.shape
        yy, xx = torch.meshgrid(torch.linspace(-1, 1, H, device=hist.device),
                                torch.linspace(-1, 1, W, device=hist.device), indexing="ij")
        z = torch.cat([hist.reshape(b, th * c, H, W), xx.expand(b, 1, H, W), yy.expand(b, 1, H, W)], 1)
        z = self.lift(z)
        for s, l in zip(self.spec, self.lin):
            z = F.gelu(s(z) + l(z))
        return hist[:, -1] + self.proj(z)


def unrolled_loss(model, hist, fut):
    loss = 0.0
    for k in range(fut.shape[1]):
        nxt = model(hist)
        loss = loss + F.mse_loss(nxt, fut[:, k])
        hist = torch.cat([hist[:, 1:], nxt.unsqueeze(1)], dim=1)
    return loss / fut.shape[1]


@torch.no_grad()
def validate(model, files, history, unroll, device, rank, world):
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for path in files[rank::world]:
        with h5py.File(path, "r") as f:
            for run in f.keys():
                g = f[run]
                q = torch.from_numpy(np.stack([g["h"][:], g["hu"][:], g["hv"][:]], 1).astype(np.float32)).to(device)
                if q.shape[0] < history + unroll:
                    continue
                tot[0] += unrolled_loss(model, q[None, :history], q[None, history:history + unroll]).double()
                tot[1] += 1
    dist.all_reduce(tot)
    return (tot[0] / tot[1].clamp(min=1)).item()


def main():
    a = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    files = sorted(glob.glob(a.shards))
    val_files = sorted(glob.glob(a.val_shards))
    ds = ShardStream(files, a.history, a.unroll, a.buffer, rank, world)
    loader = DataLoader(ds, batch_size=a.batch_size, num_workers=a.workers, pin_memory=True, drop_last=True)

    model = DDP(SWEFNO(a.history, a.modes, a.width).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"{len(files)} training shards, {len(val_files)} validation shards, world={world}", flush=True)

    for epoch in range(a.epochs):
        ds.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for hist, fut in loader:
            hist, fut = hist.to(device, non_blocking=True), fut.to(device, non_blocking=True)
            loss = unrolled_loss(model, hist, fut)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        model.eval()
        val = validate(model.module, val_files, a.history, a.unroll, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch:3d}  {time.time() - t0:7.1f}s  steps {int(stats[1].item())}  "
                  f"train {stats[0].item() / stats[1].item():.4e}  val {val:.4e}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, os.path.join(a.out, "ckpt.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
