"""Galerkin-type linear-attention transformer for transonic flow over NACA airfoils.

Data from Geo-FNO (Li et al. 2022): structured C-mesh of 221x51 nodes per airfoil,
input = mesh coordinates (x, y), output = Mach number field. 1000 train / 200 test.

    torchrun --standalone --nproc_per_node=8 20_galerkin_transformer_airfoil.py \
        --data-dir /data/geofno/naca --out runs/gt_airfoil
"""
import argparse
import math
import os
import time

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
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", default="runs/gt_airfoil")
    p.add_argument("--ntrain", type=int, default=1000)
    p.add_argument("--ntest", type=int, default=200)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--warmup-frac", type=float, default=0.2)
    return p.parse_args()


class GalerkinAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.h, self.dh = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.ln_k = nn.LayerNorm(self.dh)
        self.ln_v = nn.LayerNorm(self.dh)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        k, v = self.ln_k(k), self.ln_v(v)
        ctx = torch.einsum("bhnd,bhne->bhde", k, v) / N
        out = torch.einsum("bhnd,bhde->bhne", q, ctx)
        return self.proj(out.transpose(1, 2).reshape(B, N, D))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = GalerkinAttention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.ff(self.n2(x))


class AirfoilOperator(nn.Module):
    def __init__(self, dim, heads, layers, n_freq=16):
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.arange(n_freq // 2) * math.pi, persistent=False)
        self.lift = nn.Linear(2 + 2 * n_freq, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))
        self.out = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 1))

    def forward(self, xy):
        # xy: (B, N, 2) mesh coordinates, roughly in [-1, 1]
        ang = xy.unsqueeze(-1) * self.freqs  # (B, N, 2, F/2)
        feats = torch.cat([xy, torch.sin(ang).flatten(2), torch.cos(ang).flatten(2)], dim=-1)
        h = self.lift(feats)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).squeeze(-1)


def load(data_dir, ntrain, ntest):
    X = np.load(os.path.join(data_dir, "NACA_Cylinder_X.npy"))
    Y = np.load(os.path.join(data_dir, "NACA_Cylinder_Y.npy"))
    Q = np.load(os.path.join(data_dir, "NACA_Cylinder_Q.npy"))[:, 4]  # Mach number
    xy = torch.tensor(np.stack([X, Y], axis=-1), dtype=torch.float32).flatten(1, 2)  # (N, 221*51, 2)
    mach = torch.tensor(Q, dtype=torch.float32).flatten(1)
    xy = xy / xy.abs().amax(dim=(0, 1), keepdim=True)
    return (xy[:ntrain], mach[:ntrain]), (xy[-ntest:], mach[-ntest:])


def rel_l2(pred, y):
    return torch.linalg.norm(pred - y, dim=1) / torch.linalg.norm(y, dim=1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    (x_tr, y_tr), (x_te, y_te) = load(args.data_dir, args.ntrain, args.ntest)
    train_set, test_set = TensorDataset(x_tr, y_tr), TensorDataset(x_te, y_te)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=8)

    model = AirfoilOperator(args.dim, args.heads, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    # one-cycle schedule as in the Galerkin Transformer paper
    steps_per_epoch = len(train_set) // args.batch_size
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=steps_per_epoch, pct_start=args.warmup_frac,
                                                    div_factor=1e4, final_div_factor=1e4)

    os.makedirs(args.out, exist_ok=True)
    ckpt_file = os.path.join(args.out, "last.pt")
    start_epoch = 0
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1

    best = float("inf")
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for xy, mach in train_loader:
            xy, mach = xy.to(device, non_blocking=True), mach.to(device, non_blocking=True)
            pred = model(xy)
            loss = rel_l2(pred, mach).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            tr += torch.stack([loss.detach() * xy.shape[0], torch.tensor(float(xy.shape[0]), device=device)])

        model.eval()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for xy, mach in test_loader:
                xy, mach = xy.to(device), mach.to(device)
                te += torch.stack([rel_l2(model.module(xy), mach).sum(), torch.tensor(float(xy.shape[0]), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(te)
        test_err = (te[0] / te[1]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} | {time.time() - t0:.1f}s | lr {scheduler.get_last_lr()[0]:.2e} | "
                  f"train {(tr[0] / tr[1]).item():.4f} | test {test_err:.4f}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, ckpt_file)
            if test_err < best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        best = min(best, test_err)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
