#!/usr/bin/env python3
"""FNO for 2D Darcy flow: permeability a(x) -> pressure u(x), 421x421 grid subsampled to 85x85.

Data: piececonst_r421_N1024_smooth{1,2}.mat (Li et al. 2020).
Run: torchrun --standalone --nproc_per_node=2 11_fno_darcy_flow.py
"""
import argparse
import json
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class UnitGaussianNormalizer:
    def __init__(self, x, eps=1e-5):
        self.mean = x.mean(0)
        self.std = x.std(0)
        self.eps = eps

    def encode(self, x):
        return (x - self.mean) / (self.std + self.eps)

    def decode(self, x):
        return x * (self.std.to(x.device) + self.eps) + self.mean.to(x.device)


def rel_l2(pred, true):
    b = pred.shape[0]
    return torch.norm(pred.reshape(b, -1) - true.reshape(b, -1), dim=1) / torch.norm(true.reshape(b, -1), dim=1)


class SpectralConv2d(nn.Module):
    def __init__(self, c_in, c_out, modes1, modes2):
        super().__init__()
        self.modes1, self.modes2 = modes1, modes2
        s = 1.0 / (c_in * c_out)
        self.weights1 = nn.Parameter(s * torch.rand(c_in, c_out, modes1, modes2, 2))
        self.weights2 = nn.Parameter(s * torch.rand(c_in, c_out, modes1, modes2, 2))

    def forward(self, x):
        b, _, h, w = x.shape
        x_ft = torch.fft.rfft2(x)
        out = torch.zeros(b, self.weights1.shape[1], h, w // 2 + 1, dtype=torch.cfloat, device=x.device)
        w1, w2 = torch.view_as_complex(self.weights1), torch.view_as_complex(self.weights2)
        out[:, :, : self.modes1, : self.modes2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, : self.modes1, : self.modes2], w1)
        out[:, :, -self.modes1:, : self.modes2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -self.modes1:, : self.modes2], w2)
        return torch.fft.irfft2(out, s=(h, w))


class FNO2d(nn.Module):
    def __init__(self, modes=12, width=32, padding=9):
        super().__init__()
        self.padding = padding
        self.fc0 = nn.Linear(3, width)
        self.spec = nn.ModuleList([SpectralConv2d(width, width, modes, modes) for _ in range(4)])
        self.w = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(4)])
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, 1)

    def forward(self, a):  # a: (B, S, S, 1)
        b, sx, sy, _ = a.shape
        gx = torch.linspace(0, 1, sx, device=a.device).view(1, sx, 1, 1).expand(b, sx, sy, 1)
        gy = torch.linspace(0, 1, sy, device=a.device).view(1, 1, sy, 1).expand(b, sx, sy, 1)
        x = self.fc0(torch.cat([a, gx, gy], -1)).permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for i in range(4):
            x = self.spec[i](x) + self.w[i](x)
            if i < 3:
                x = F.gelu(x)
        x = x[..., : -self.padding, : -self.padding].permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x)))


def load_mat(path, n, r, s):
    d = scipy.io.loadmat(path)
    a = torch.from_numpy(d["coeff"][:n, ::r, ::r][:, :s, :s].astype(np.float32))
    u = torch.from_numpy(d["sol"][:n, ::r, ::r][:, :s, :s].astype(np.float32))
    return a, u


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--train-mat", default="data/piececonst_r421_N1024_smooth1.mat")
    p.add_argument("--test-mat", default="data/piececonst_r421_N1024_smooth2.mat")
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=100)
    p.add_argument("--r", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--out", default="runs/fno_darcy")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(0)

    s = int(((421 - 1) / args.r) + 1)
    x_train, y_train = load_mat(args.train_mat, args.ntrain, args.r, s)
    x_test, y_test = load_mat(args.test_mat, args.ntest, args.r, s)
    x_norm = UnitGaussianNormalizer(x_train)
    y_norm = UnitGaussianNormalizer(y_train)
    x_train, x_test = x_norm.encode(x_train), x_norm.encode(x_test)
    y_train_enc = y_norm.encode(y_train)

    train_ds = TensorDataset(x_train.unsqueeze(-1), y_train_enc.unsqueeze(-1))
    test_ds = TensorDataset(x_test[rank::world].unsqueeze(-1), y_test[rank::world].unsqueeze(-1))
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=args.batch_size, shuffle=False)

    model = DDP(FNO2d(args.modes, args.width).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)

    history = []
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        t1 = time.time()
        train_l2, n_train = 0.0, 0
        for a, u in train_loader:
            a, u = a.to(dev, non_blocking=True), u.to(dev, non_blocking=True)
            out = model(a)
            # loss in physical units, as in the reference implementation
            loss = rel_l2(y_norm.decode(out.squeeze(-1)), y_norm.decode(u.squeeze(-1))).sum()
            opt.zero_grad()
            (loss / a.shape[0]).backward()
            opt.step()
            train_l2 += loss.item()
            n_train += a.shape[0]
        sched.step()

        model.eval()
        test_l2, n_test = 0.0, 0
        with torch.no_grad():
            for a, u in test_loader:
                a, u = a.to(dev), u.to(dev)
                out = y_norm.decode(model.module(a).squeeze(-1))
                test_l2 += rel_l2(out, u.squeeze(-1)).sum().item()
                n_test += a.shape[0]

        totals = torch.tensor([train_l2, n_train, test_l2, n_test], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        tr, te = (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()
        history.append({"epoch": ep, "train_rel_l2": tr, "test_rel_l2": te})
        if rank == 0:
            print(f"ep {ep:4d} {time.time() - t1:6.2f}s train {tr:.5f} test {te:.5f}", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "x_norm": (x_norm.mean, x_norm.std),
                    "y_norm": (y_norm.mean, y_norm.std), "args": vars(args)}, os.path.join(args.out, "fno_darcy.pt"))
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump(history, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
