#!/usr/bin/env python
"""Fourier Neural Operator (Li et al., 2020) on the 2D Darcy flow benchmark.

The data file holds the permeability field ``coeff`` and the pressure solution
``sol`` on a 421x421 grid; we train on the subsampled grid (sub=5 -> 85x85).

    torchrun --standalone --nproc_per_node=4 01_fno_darcy.py \
        --data /scratch/pde/darcy_r421_N1200.h5 --out runs/fno_darcy
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser(description="FNO-2D Darcy")
    p.add_argument("--data", type=str, required=True)
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=200)
    p.add_argument("--sub", type=int, default=5)
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=5, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--step-size", type=int, default=100)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=str, default="runs/fno_darcy")
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class UnitGaussianNormalizer:
    def __init__(self, x, eps=1e-5):
        self.mean = x.mean(0)
        self.std = x.std(0)
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        std = self.std.to(x.device) + self.eps
        mean = self.mean.to(x.device)
        return x * std + mean


class SpectralConv2d(nn.Module):
    def __init__(self, in_ch, out_ch, modes1, modes2):
        super().__init__()
        self.out_ch = out_ch
        self.modes1 = modes1
        self.modes2 = modes2
        scale = 1.0 / (in_ch * out_ch)
        self.w1 = nn.Parameter(scale * torch.rand(in_ch, out_ch, modes1, modes2, dtype=torch.cfloat))
        self.w2 = nn.Parameter(scale * torch.rand(in_ch, out_ch, modes1, modes2, dtype=torch.cfloat))

    @staticmethod
    def compl_mul2d(a, w):
        return torch.einsum("bixy,ioxy->boxy", a, w)

    def forward(self, x):
        b, _, h, w = x.shape
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.out_ch, h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        m1, m2 = self.modes1, self.modes2
        out_ft[:, :, :m1, :m2] = self.compl_mul2d(x_ft[:, :, :m1, :m2], self.w1)
        out_ft[:, :, -m1:, :m2] = self.compl_mul2d(x_ft[:, :, -m1:, :m2], self.w2)
        return torch.fft.irfft2(out_ft, s=(h, w))


class FNO2d(nn.Module):
    def __init__(self, modes1, modes2, width, padding=9):
        super().__init__()
        self.padding = padding
        self.fc0 = nn.Linear(3, width)  # (a(x, y), x, y)
        self.convs = nn.ModuleList([SpectralConv2d(width, width, modes1, modes2) for _ in range(4)])
        self.ws = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(4)])
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, 1)

    @staticmethod
    def get_grid(shape, device):
        b, sx, sy = shape[0], shape[1], shape[2]
        gx = torch.linspace(0, 1, sx, device=device).reshape(1, sx, 1, 1).repeat(b, 1, sy, 1)
        gy = torch.linspace(0, 1, sy, device=device).reshape(1, 1, sy, 1).repeat(b, sx, 1, 1)
        return torch.cat((gx, gy), dim=-1)

    def forward(self, x):
        # x: (b, sx, sy, 1)
        x = torch.cat((x, self.get_grid(x.shape, x.device)), dim=-1)
        x = self.fc0(x).permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for i, (conv, w) in enumerate(zip(self.convs, self.ws)):
            x = conv(x) + w(x)
            if i < 3:
                x = F.gelu(x)
        x = x[..., : -self.padding, : -self.padding]
        x = x.permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x)))


def rel_l2(pred, target):
    b = pred.shape[0]
    diff = torch.linalg.norm(pred.reshape(b, -1) - target.reshape(b, -1), dim=1)
    ref = torch.linalg.norm(target.reshape(b, -1), dim=1)
    return diff / ref


def load_darcy(path, ntrain, ntest, sub):
    with h5py.File(path, "r") as f:
        coeff = np.asarray(f["coeff"][:, ::sub, ::sub], dtype=np.float32)
        sol = np.asarray(f["sol"][:, ::sub, ::sub], dtype=np.float32)
    x, y = torch.from_numpy(coeff), torch.from_numpy(sol)
    return x[:ntrain], y[:ntrain], x[-ntest:], y[-ntest:]


@torch.no_grad()
def evaluate(model, loader, y_norm, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = y_norm.decode(model(x.unsqueeze(-1)).squeeze(-1))
        stats[0] += rel_l2(out, y).sum()
        stats[1] += x.shape[0]
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    x_train, y_train, x_test, y_test = load_darcy(args.data, args.ntrain, args.ntest, args.sub)
    x_norm = UnitGaussianNormalizer(x_train)
    y_norm = UnitGaussianNormalizer(y_train)
    x_train, x_test = x_norm.encode(x_train), x_norm.encode(x_test)

    train_ds = TensorDataset(x_train, y_train)
    test_ds = TensorDataset(x_test, y_test)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # every test sample exactly once, no padding
    test_shard = Subset(test_ds, list(range(rank, len(test_ds), world_size)))
    test_loader = DataLoader(test_shard, batch_size=args.batch_size, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = FNO2d(args.modes, args.modes, args.width).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch = 0
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']}")

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world={world_size} params={n_params} train={len(train_ds)} test={len(test_ds)}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x = x.to(device, non_blocking=True).unsqueeze(-1)
            y = y.to(device, non_blocking=True)
            out = model(x).squeeze(-1)
            out = y_norm.decode(out)
            loss = rel_l2(out, y).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running[0] += loss.detach() * x.shape[0]
            running[1] += x.shape[0]
        scheduler.step()

        dist.all_reduce(running)
        train_l2 = (running[0] / running[1]).item()
        test_l2 = evaluate(model, test_loader, y_norm, device)
        if rank == 0:
            print(f"epoch {epoch:4d} | {time.time() - t0:6.1f}s | lr {scheduler.get_last_lr()[0]:.2e} "
                  f"| train relL2 {train_l2:.5f} | test relL2 {test_l2:.5f}", flush=True)

        if (epoch + 1) % args.save_every == 0 or epoch == args.epochs - 1:
            if rank == 0:
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "epoch": epoch,
                            "args": vars(args)}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
