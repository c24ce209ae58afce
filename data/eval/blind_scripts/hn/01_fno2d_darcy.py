#!/usr/bin/env python
"""Fourier Neural Operator (2D) for steady Darcy flow.

Data: the piecewise-constant Darcy set from Li et al. (2020), stored as MATLAB v7.3
(HDF5) files with datasets "coeff" (permeability a(x)) and "sol" (pressure u(x)).

    torchrun --standalone --nproc_per_node=4 01_fno2d_darcy.py \
        --train-file /data/darcy/piececonst_r421_N1024_smooth1.mat \
        --test-file /data/darcy/piececonst_r421_N1024_smooth2.mat
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
    p = argparse.ArgumentParser()
    p.add_argument("--train-file", required=True)
    p.add_argument("--test-file", required=True)
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=100)
    p.add_argument("--sub", type=int, default=5, help="spatial subsampling factor (421 -> 85)")
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=5, help="per-GPU batch size")
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--step-size", type=int, default=100)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="runs/fno_darcy")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", default="")
    return p.parse_args()


def read_darcy(path, n, sub):
    # v7.3 .mat files are HDF5 with MATLAB's column-major layout
    with h5py.File(path, "r") as f:
        a = np.array(f["coeff"][:n]).transpose(0, 2, 1)
        u = np.array(f["sol"][:n]).transpose(0, 2, 1)
    a = torch.from_numpy(a[:, ::sub, ::sub].astype(np.float32))
    u = torch.from_numpy(u[:, ::sub, ::sub].astype(np.float32))
    return a, u


class UnitGaussianNormalizer:
    def __init__(self, x, eps=1e-5):
        self.mean = x.mean(0)
        self.std = x.std(0)
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        return x * (self.std.to(x.device) + self.eps) + self.mean.to(x.device)


class RelLpLoss:
    def __init__(self, p=2, reduction="sum"):
        self.p = p
        self.reduction = reduction

    def __call__(self, pred, target):
        b = pred.shape[0]
        diff = torch.norm(pred.reshape(b, -1) - target.reshape(b, -1), self.p, dim=1)
        ref = torch.norm(target.reshape(b, -1), self.p, dim=1)
        rel = diff / ref
        return rel.sum() if self.reduction == "sum" else rel.mean()


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, m1, m2):
        super().__init__()
        self.m1, self.m2 = m1, m2
        scale = 1.0 / (cin * cout)
        self.w1 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))
        self.w2 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))

    def forward(self, x):
        b, _, h, w = x.shape
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.w1.shape[1], h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, : self.m1, : self.m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, : self.m1, : self.m2], self.w1)
        out_ft[:, :, -self.m1 :, : self.m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -self.m1 :, : self.m2], self.w2)
        return torch.fft.irfft2(out_ft, s=(h, w))


class FNO2d(nn.Module):
    def __init__(self, modes, width, n_layers=4, padding=9):
        super().__init__()
        self.padding = padding
        self.lift = nn.Linear(3, width)
        self.spectral = nn.ModuleList([SpectralConv2d(width, width, modes, modes) for _ in range(n_layers)])
        self.pointwise = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(n_layers)])
        self.proj1 = nn.Linear(width, 128)
        self.proj2 = nn.Linear(128, 1)

    @staticmethod
    def grid(b, h, w, device):
        gx = torch.linspace(0, 1, h, device=device).view(1, h, 1, 1).expand(b, h, w, 1)
        gy = torch.linspace(0, 1, w, device=device).view(1, 1, w, 1).expand(b, h, w, 1)
        return torch.cat([gx, gy], dim=-1)

    def forward(self, a):
        b, h, w = a.shape
        x = torch.cat([a.unsqueeze(-1), self.grid(b, h, w, a.device)], dim=-1)
        x = self.lift(x).permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for i, (sc, pw) in enumerate(zip(self.spectral, self.pointwise)):
            x = sc(x) + pw(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        x = x[..., :-self.padding, :-self.padding]
        x = x.permute(0, 2, 3, 1)
        x = self.proj2(F.gelu(self.proj1(x)))
        return x.squeeze(-1)


def setup():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank)


def main():
    args = parse_args()
    rank, world_size, device = setup()
    torch.manual_seed(0)
    is_main = rank == 0

    a_train, u_train = read_darcy(args.train_file, args.ntrain, args.sub)
    a_test, u_test = read_darcy(args.test_file, args.ntest, args.sub)
    a_norm = UnitGaussianNormalizer(a_train)
    u_norm = UnitGaussianNormalizer(u_train)
    a_train, a_test = a_norm.encode(a_train), a_norm.encode(a_test)
    u_train_enc = u_norm.encode(u_train)

    train_ds = TensorDataset(a_train, u_train_enc)
    test_ds = TensorDataset(a_test, u_test)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # strided split of the test set: no padded duplicates in the metric
    test_shard = Subset(test_ds, list(range(rank, len(test_ds), world_size)))
    test_loader = DataLoader(test_shard, batch_size=args.batch_size, shuffle=False)

    model = FNO2d(args.modes, args.width).to(device)
    model = DDP(model, device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)
    loss_fn = RelLpLoss(reduction="sum")

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if is_main:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() * (2 if p.is_complex() else 1) for p in model.parameters())
        print(f"world_size={world_size} params={n_params / 1e6:.2f}M train={len(train_ds)} test={len(test_ds)}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for a, u in train_loader:
            a = a.to(device, non_blocking=True)
            u = u.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            pred = model(a)
            pred = u_norm.decode(pred)
            target = u_norm.decode(u)
            loss = loss_fn(pred, target)
            (loss / a.shape[0]).backward()
            optimizer.step()
            stats[0] += loss.detach()
            stats[1] += a.shape[0]
        scheduler.step()

        model.eval()
        test_stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, u in test_loader:
                a, u = a.to(device), u.to(device)
                pred = u_norm.decode(model.module(a))
                test_stats[0] += loss_fn(pred, u)
                test_stats[1] += a.shape[0]

        dist.all_reduce(stats)
        dist.all_reduce(test_stats)
        if is_main:
            print(f"epoch {epoch:4d} | {time.time() - t0:6.2f}s | train rel-L2 {(stats[0] / stats[1]).item():.5f}"
                  f" | test rel-L2 {(test_stats[0] / test_stats[1]).item():.5f} | lr {scheduler.get_last_lr()[0]:.2e}")
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "epoch": epoch,
                            "a_norm": (a_norm.mean, a_norm.std),
                            "u_norm": (u_norm.mean, u_norm.std)},
                           os.path.join(args.out, f"fno_darcy_ep{epoch + 1}.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
