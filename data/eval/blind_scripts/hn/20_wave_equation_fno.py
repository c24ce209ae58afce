"""FNO surrogate for the 2D acoustic wave equation in heterogeneous media.

    u_tt = div(c(x)^2 grad u),  u(x,0) = Gaussian pulse at a random source, u_t(x,0) = 0

The operator maps (c(x), u0(x)) to the wavefield at 10 later snapshots. Data generated
with a 4th-order finite-difference solver, stored in HDF5:
    c [N, 128, 128], u [N, 11, 128, 128]

    torchrun --standalone --nproc_per_node=4 20_wave_equation_fno.py --data /data/wave/wave2d_c_marmousi_patches.h5
"""
import argparse
import logging
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("wave-fno")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/wave_fno")
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--modes", type=int, default=24)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--patience", type=int, default=10)
    return p.parse_args()


class WaveData(Dataset):
    def __init__(self, path, lo, hi):
        self.path, self.lo, self.hi = path, lo, hi
        with h5py.File(path, "r") as f:
            self.c_mean = float(f.attrs["c_mean"])
            self.c_std = float(f.attrs["c_std"])
        self.f = None

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        j = self.lo + i
        c = (self.f["c"][j].astype(np.float32) - self.c_mean) / self.c_std
        u = self.f["u"][j].astype(np.float32)
        x = np.stack([c, u[0]])
        return torch.from_numpy(x), torch.from_numpy(u[1:])


class SpectralConv2d(nn.Module):
    def __init__(self, ci, co, m):
        super().__init__()
        self.m = m
        self.w = nn.Parameter(torch.randn(2, ci, co, m, m, dtype=torch.cfloat) * (1.0 / (ci * co)))

    def forward(self, x):
        m = self.m
        xf = torch.fft.rfft2(x, norm="ortho")
        y = torch.zeros(x.size(0), self.w.size(2), x.size(2), x.size(3) // 2 + 1, dtype=torch.cfloat, device=x.device)
        y[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], self.w[0])
        y[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -m:, :m], self.w[1])
        return torch.fft.irfft2(y, s=(x.size(2), x.size(3)), norm="ortho")


class WaveFNO(nn.Module):
    def __init__(self, modes, width, layers, n_out=10, pad=16):
        super().__init__()
        self.pad = pad
        self.lift = nn.Conv2d(4, width, 1)
        self.spec = nn.ModuleList([SpectralConv2d(width, width, modes) for _ in range(layers)])
        self.w = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(layers)])
        self.proj = nn.Sequential(nn.Conv2d(width, 128, 1), nn.GELU(), nn.Conv2d(128, n_out, 1))

    def forward(self, x):
        b, _, H, W = x.shape
        gy, gx = torch.meshgrid(torch.linspace(0, 1, H, device=x.device), torch.linspace(0, 1, W, device=x.device),
                                indexing="ij")
        x = torch.cat([x, gx.expand(b, 1, H, W), gy.expand(b, 1, H, W)], 1)
        h = F.pad(self.lift(x), (0, self.pad, 0, self.pad))  # non-periodic domain
        for i, (s, w) in enumerate(zip(self.spec, self.w)):
            h = s(h) + w(h)
            if i < len(self.spec) - 1:
                h = F.gelu(h)
        return self.proj(h[..., :H, :W])


def rel_l2(pred, y):
    b = pred.shape[0]
    return (pred - y).reshape(b, -1).norm(dim=1) / y.reshape(b, -1).norm(dim=1)


def global_mean(total, count):
    t = torch.tensor([total, count], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t[0] / t[1]).item()


def run_epoch(model, loader, device, opt=None):
    training = opt is not None
    model.train(training)
    total, count = 0.0, 0
    with torch.set_grad_enabled(training):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            err = rel_l2(model(x), y)
            if training:
                opt.zero_grad(set_to_none=True)
                err.mean().backward()
                opt.step()
            total += err.sum().item()
            count += x.shape[0]
    return global_mean(total, count)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    with h5py.File(args.data, "r") as f:
        n = f["u"].shape[0]
    train_ds = WaveData(args.data, 0, n - args.n_test)
    test_ds = WaveData(args.data, n - args.n_test, n)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                             batch_size=args.batch_size, num_workers=2)

    net = WaveFNO(args.modes, args.width, args.layers).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_err = run_epoch(model, train_loader, device, opt)
        test_err = run_epoch(net, test_loader, device)
        sched.step()
        log.info("epoch %3d  %5.1fs  train rel-L2 %.4f  test rel-L2 %.4f", epoch, time.time() - t0, train_err, test_err)
        if test_err < best:
            best, bad_epochs = test_err, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "test_rel_l2": test_err},
                           os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        if bad_epochs >= args.patience:
            log.info("early stopping at epoch %d (best %.4f)", epoch, best)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
