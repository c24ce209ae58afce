#!/usr/bin/env python
"""FNO-1D for the Burgers equation (nu = 0.1), initial condition -> solution at t = 1.

Data: burgers_data_R10.mat (2048 samples on 8192 points), subsampled by 2**3.
Learning rate is reduced on validation plateaus, the best model is kept.

Usage:
    torchrun --standalone --nproc_per_node=4 13_fno1d_burgers_plateau.py \
        --mat data/burgers_data_R10.mat --save-dir checkpoints/fno1d_burgers
"""
import argparse
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def build_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mat", required=True)
    ap.add_argument("--save-dir", default="checkpoints/fno1d_burgers")
    ap.add_argument("--ntrain", type=int, default=1000)
    ap.add_argument("--nval", type=int, default=100)
    ap.add_argument("--ntest", type=int, default=100)
    ap.add_argument("--sub", type=int, default=8)
    ap.add_argument("--modes", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--patience", type=int, default=10)
    return ap


class SpectralConv1d(nn.Module):
    def __init__(self, cin, cout, modes):
        super().__init__()
        self.cout, self.modes = cout, modes
        self.weight = nn.Parameter(torch.rand(cin, cout, modes, dtype=torch.cfloat) / (cin * cout))

    def forward(self, x):
        B, _, N = x.shape
        xf = torch.fft.rfft(x)
        out = torch.zeros(B, self.cout, N // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, :self.modes] = torch.einsum("bix,iox->box", xf[:, :, :self.modes], self.weight)
        return torch.fft.irfft(out, n=N)


class FNO1d(nn.Module):
    def __init__(self, modes, width, n_layers=4):
        super().__init__()
        self.fc0 = nn.Linear(2, width)
        self.spectral = nn.ModuleList(SpectralConv1d(width, width, modes) for _ in range(n_layers))
        self.local = nn.ModuleList(nn.Conv1d(width, width, 1) for _ in range(n_layers))
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, 1)

    def forward(self, a):
        # a: (B, N)
        B, N = a.shape
        grid = torch.linspace(0, 1, N, device=a.device).expand(B, N)
        h = self.fc0(torch.stack([a, grid], dim=-1)).transpose(1, 2)
        for i, (sp, lc) in enumerate(zip(self.spectral, self.local)):
            h = sp(h) + lc(h)
            if i < len(self.spectral) - 1:
                h = F.gelu(h)
        h = h.transpose(1, 2)
        return self.fc2(F.gelu(self.fc1(h))).squeeze(-1)


def relative_l2(pred, true):
    return (torch.linalg.norm(pred - true, dim=1) / torch.linalg.norm(true, dim=1)).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total, count = 0.0, 0
    for a, u in loader:
        a, u = a.to(device), u.to(device)
        total += relative_l2(model(a), u).item() * a.shape[0]
        count += a.shape[0]
    return total / max(count, 1)


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    mat = scipy.io.loadmat(args.mat)
    a = torch.tensor(mat["a"][:, ::args.sub], dtype=torch.float32)
    u = torch.tensor(mat["u"][:, ::args.sub], dtype=torch.float32)
    n_tr, n_va, n_te = args.ntrain, args.nval, args.ntest
    train_set = TensorDataset(a[:n_tr], u[:n_tr])
    val_set = TensorDataset(a[n_tr:n_tr + n_va], u[n_tr:n_tr + n_va])
    test_set = TensorDataset(a[-n_te:], u[-n_te:])

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=50)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=50)

    model = DDP(FNO1d(args.modes, args.width).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5,
                                                           patience=args.patience, min_lr=1e-6)

    os.makedirs(args.save_dir, exist_ok=True)
    best_file = os.path.join(args.save_dir, "best.pt")
    last_file = os.path.join(args.save_dir, "last.pt")
    start_epoch, best_val = 0, float("inf")
    if os.path.exists(last_file):
        state = torch.load(last_file, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best_val = state["epoch"] + 1, state["best_val"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        train_sum = torch.zeros(2, device=device)
        for a_b, u_b in train_loader:
            a_b, u_b = a_b.to(device, non_blocking=True), u_b.to(device, non_blocking=True)
            loss = relative_l2(model(a_b), u_b)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            train_sum += torch.stack([loss.detach() * a_b.shape[0], torch.tensor(float(a_b.shape[0]), device=device)])
        dist.all_reduce(train_sum)

        val_l2 = evaluate(model, val_loader, device)
        scheduler.step(val_l2)

        if rank == 0:
            print(f"epoch {epoch:4d} | {time.time() - t0:5.2f}s | train {(train_sum[0] / train_sum[1]).item():.5f} "
                  f"| val {val_l2:.5f} | lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_val": min(best_val, val_l2)}
            torch.save(state, last_file)
            if val_l2 < best_val:
                torch.save(state, best_file)
        best_val = min(best_val, val_l2)
        dist.barrier()

    # final test with the best weights
    best = torch.load(best_file, map_location=device)
    model.module.load_state_dict(best["model"])
    test_l2 = torch.tensor([evaluate(model, test_loader, device) * len(test_loader.dataset),
                            float(len(test_loader.dataset))], device=device)
    dist.all_reduce(test_l2)
    if rank == 0:
        print(f"best epoch {best['epoch']} | test relative L2 {(test_l2[0] / test_l2[1]).item():.5f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
