"""FNO-3D (2D space + time) for Navier-Stokes, nu = 1e-3, 64x64 grid, T = 10 -> 40.

The first 10 vorticity snapshots are repeated along a time axis of length 40 and the
network predicts all 40 future snapshots at once (Li et al., fourier_3d).
Single node, one process per visible GPU, started with torch.multiprocessing:

    python 14_fno3d_spacetime_spawn.py --data /data/ns/ns_V1e-3_N5000_T50.mat --epochs 500
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=200)
    p.add_argument("--t-in", type=int, default=10)
    p.add_argument("--t-out", type=int, default=40)
    p.add_argument("--modes", type=int, default=8)
    p.add_argument("--width", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--port", type=str, default="29533")
    p.add_argument("--ckpt", type=str, default="checkpoints/fno3d_ns.pt")
    return p.parse_args()


class SpectralConv3d(nn.Module):
    def __init__(self, cin, cout, m1, m2, m3):
        super().__init__()
        self.cout, self.m = cout, (m1, m2, m3)
        scale = 1 / (cin * cout)
        self.w = nn.ParameterList(
            nn.Parameter(scale * torch.rand(cin, cout, m1, m2, m3, dtype=torch.cfloat)) for _ in range(4))

    def forward(self, x):
        B, _, X, Y, T = x.shape
        m1, m2, m3 = self.m
        xf = torch.fft.rfftn(x, dim=[-3, -2, -1])
        out = torch.zeros(B, self.cout, X, Y, T // 2 + 1, dtype=torch.cfloat, device=x.device)
        mul = lambda a, w: torch.einsum("bixyz,ioxyz->boxyz", a, w)
        out[:, :, :m1, :m2, :m3] = mul(xf[:, :, :m1, :m2, :m3], self.w[0])
        out[:, :, -m1:, :m2, :m3] = mul(xf[:, :, -m1:, :m2, :m3], self.w[1])
        out[:, :, :m1, -m2:, :m3] = mul(xf[:, :, :m1, -m2:, :m3], self.w[2])
        out[:, :, -m1:, -m2:, :m3] = mul(xf[:, :, -m1:, -m2:, :m3], self.w[3])
        return torch.fft.irfftn(out, s=(X, Y, T))


class FNO3d(nn.Module):
    def __init__(self, t_in, modes, width, pad=6):
        super().__init__()
        self.pad = pad
        self.fc0 = nn.Linear(t_in + 3, width)
        self.convs = nn.ModuleList(SpectralConv3d(width, width, modes, modes, modes) for _ in range(4))
        self.ws = nn.ModuleList(nn.Conv3d(width, width, 1) for _ in range(4))
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, 1)

    def forward(self, x):
        # x: (B, X, Y, T, t_in)
        B, X, Y, T, _ = x.shape
        gx = torch.linspace(0, 1, X, device=x.device).view(1, X, 1, 1, 1).expand(B, X, Y, T, 1)
        gy = torch.linspace(0, 1, Y, device=x.device).view(1, 1, Y, 1, 1).expand(B, X, Y, T, 1)
        gt = torch.linspace(0, 1, T, device=x.device).view(1, 1, 1, T, 1).expand(B, X, Y, T, 1)
        h = self.fc0(torch.cat([x, gx, gy, gt], dim=-1)).permute(0, 4, 1, 2, 3)
        h = F.pad(h, [0, self.pad])
        for i, (conv, w) in enumerate(zip(self.convs, self.ws)):
            h = conv(h) + w(h)
            if i < 3:
                h = F.gelu(h)
        h = h[..., :-self.pad].permute(0, 2, 3, 4, 1)
        return self.fc2(F.gelu(self.fc1(h))).squeeze(-1)


def load_data(args):
    with h5py.File(args.data, "r") as f:
        u = torch.from_numpy(np.array(f["u"], dtype=np.float32)).permute(3, 1, 2, 0)  # (N, X, Y, T)
    a = u[..., :args.t_in]
    y = u[..., args.t_in:args.t_in + args.t_out]
    a = a.unsqueeze(3).repeat(1, 1, 1, args.t_out, 1)  # (N, X, Y, t_out, t_in)
    return TensorDataset(a[:args.ntrain], y[:args.ntrain]), TensorDataset(a[-args.ntest:], y[-args.ntest:])


def rel_l2(pred, y):
    B = pred.shape[0]
    return torch.linalg.norm((pred - y).reshape(B, -1), dim=1) / torch.linalg.norm(y.reshape(B, -1), dim=1)


def train_worker(gpu, ngpus_per_node, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=ngpus_per_node, rank=gpu)
    device = torch.device("cuda", gpu)
    torch.manual_seed(0)

    train_set, test_set = load_data(args)
    sampler = DistributedSampler(train_set, num_replicas=ngpus_per_node, rank=gpu, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(gpu, len(test_set), ngpus_per_node)), batch_size=args.batch_size)

    model = DDP(FNO3d(args.t_in, args.modes, args.width).to(device), device_ids=[gpu])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    start = 0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        tr = torch.zeros(2, device=device)
        for a, y in train_loader:
            a, y = a.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = rel_l2(model(a), y).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            tr += torch.stack([loss.detach() * a.shape[0], torch.tensor(float(a.shape[0]), device=device)])

        model.eval()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, y in test_loader:
                a, y = a.to(device), y.to(device)
                te += torch.stack([rel_l2(model.module(a), y).sum(), torch.tensor(float(a.shape[0]), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(te)
        if gpu == 0:
            print(f"epoch {epoch} | {time.time() - tic:.1f}s | train {(tr[0] / tr[1]).item():.4f} "
                  f"| test {(te[0] / te[1]).item():.4f}", flush=True)
            if epoch % 10 == 9 or epoch == args.epochs - 1:
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    ngpus = torch.cuda.device_count()
    mp.spawn(train_worker, nprocs=ngpus, args=(args, ngpus))
