#!/usr/bin/env python
"""Train a 2D Fourier Neural Operator on the Darcy flow benchmark
(piecewise-constant permeability -> steady-state pressure).

Launched with torchrun from scripts/fno_darcy.sbatch (2 nodes x 4 GPUs).
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser(description="FNO-2D Darcy")
    p.add_argument("--train-file", default="/lustre/proj/sciml/darcy/piececonst_r421_N1024_smooth1.h5")
    p.add_argument("--test-file", default="/lustre/proj/sciml/darcy/piececonst_r421_N1024_smooth2.h5")
    p.add_argument("--out-dir", default="/lustre/proj/sciml/runs/fno_darcy")
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=200)
    p.add_argument("--sub", type=int, default=5)
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--step-size", type=int, default=100)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class UnitGaussianNormalizer:
    def __init__(self, x, eps=1e-5):
        self.mean = x.mean(0)
        self.std = x.std(0)
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        return x * (self.std.to(x.device) + self.eps) + self.mean.to(x.device)


class DarcyDataset(Dataset):
    def __init__(self, a, u):
        self.a = a
        self.u = u
        n, s, _ = a.shape
        grid = torch.linspace(0, 1, s)
        gx, gy = torch.meshgrid(grid, grid, indexing="ij")
        self.grid = torch.stack([gx, gy], dim=-1)

    def __len__(self):
        return self.a.shape[0]

    def __getitem__(self, i):
        x = torch.cat([self.a[i].unsqueeze(-1), self.grid], dim=-1)
        return x, self.u[i]


def load_field(path, n, sub):
    with h5py.File(path, "r") as f:
        a = f["coeff"][:n, ::sub, ::sub]
        u = f["sol"][:n, ::sub, ::sub]
    return torch.from_numpy(a.astype(np.float32)), torch.from_numpy(u.astype(np.float32))


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
        out = torch.zeros(b, self.w1.shape[1], h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, : self.m1, : self.m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, : self.m1, : self.m2], self.w1)
        out[:, :, -self.m1 :, : self.m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -self.m1 :, : self.m2], self.w2)
        return torch.fft.irfft2(out, s=(h, w))


class FNO2d(nn.Module):
    def __init__(self, modes, width, n_layers=4, padding=9):
        super().__init__()
        self.padding = padding
        self.lift = nn.Linear(3, width)
        self.spectral = nn.ModuleList([SpectralConv2d(width, width, modes, modes) for _ in range(n_layers)])
        self.pointwise = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(n_layers)])
        self.proj1 = nn.Linear(width, 128)
        self.proj2 = nn.Linear(128, 1)

    def forward(self, x):
        x = self.lift(x).permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for i, (sc, pw) in enumerate(zip(self.spectral, self.pointwise)):
            x = sc(x) + pw(x)
            if i < len(self.spectral) - 1:
                x = F.gelu(x)
        x = x[..., : -self.padding, : -self.padding].permute(0, 2, 3, 1)
        return self.proj2(F.gelu(self.proj1(x))).squeeze(-1)


def rel_l2(pred, target):
    b = pred.shape[0]
    diff = torch.linalg.norm(pred.reshape(b, -1) - target.reshape(b, -1), dim=1)
    return diff / torch.linalg.norm(target.reshape(b, -1), dim=1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)

    a_tr, u_tr = load_field(args.train_file, args.ntrain, args.sub)
    a_te, u_te = load_field(args.test_file, args.ntest, args.sub)
    a_norm, u_norm = UnitGaussianNormalizer(a_tr), UnitGaussianNormalizer(u_tr)
    train_ds = DarcyDataset(a_norm.encode(a_tr), u_norm.encode(u_tr))
    test_ds = DarcyDataset(a_norm.encode(a_te), u_te)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    # test shard without padding so every sample is counted once
    test_shard = Subset(test_ds, list(range(rank, len(test_ds), world_size)))
    test_loader = DataLoader(test_shard, batch_size=args.batch_size, num_workers=2)

    model = FNO2d(args.modes, args.width).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=args.gamma)

    start_epoch = 0
    ckpt_path = os.path.join(args.out_dir, "checkpoint_last.pt")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {ckpt_path} at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        train_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            out = model(x)
            out = u_norm.decode(out)
            y = u_norm.decode(y)
            loss = rel_l2(out, y).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            train_sum[0] += loss.detach()
            train_sum[1] += x.shape[0]
        scheduler.step()

        model.eval()
        test_sum = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device), y.to(device)
                out = u_norm.decode(model.module(x))
                test_sum[0] += rel_l2(out, y).sum()
                test_sum[1] += x.shape[0]
        dist.all_reduce(train_sum)
        dist.all_reduce(test_sum)

        if rank == 0:
            print(f"epoch {epoch:4d} | train relL2 {(train_sum[0] / train_sum[1]).item():.5f} "
                  f"| test relL2 {(test_sum[0] / test_sum[1]).item():.5f} | {time.time() - t0:.1f}s",
                  flush=True)

        if (epoch + 1) % args.ckpt_every == 0 or epoch == args.epochs - 1:
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "args": vars(args),
            }
            torch.save(state, ckpt_path)
            if rank == 0:
                print(f"saved {ckpt_path}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
