"""PDEBench 2D diffusion-reaction (FitzHugh-Nagumo, u and v) with an autoregressive FNO.

File layout (2D_diff-react_NA_NA.h5): 1000 groups "0000".."0999", each with
data [101, 128, 128, 2] and grid/{x, y, t}.

    torchrun --standalone --nproc_per_node=4 13_pdebench_diff_react.py \
        --file /data/pdebench/2D/diffusion-reaction/2D_diff-react_NA_NA.h5
"""
import argparse
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--file", required=True)
    p.add_argument("--out", default="runs/pdebench_dr")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--initial-step", type=int, default=10)
    p.add_argument("--t-train", type=int, default=101)
    p.add_argument("--reduced-t", type=int, default=1, help="temporal subsampling")
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=5)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--scheduler-step", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.0, help="input noise std (augmentation)")
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


class DiffReactDataset(Dataset):
    def __init__(self, path, keys, initial_step, reduced_t):
        self.path, self.keys = path, list(keys)
        self.initial_step, self.reduced_t = initial_step, reduced_t
        self.h5 = None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        g = self.h5[self.keys[i]]
        data = torch.from_numpy(g["data"][::self.reduced_t].astype(np.float32))  # [T, X, Y, 2]
        data = data.permute(1, 2, 0, 3)  # [X, Y, T, 2]
        x = torch.from_numpy(g["grid/x"][:].astype(np.float32))
        y = torch.from_numpy(g["grid/y"][:].astype(np.float32))
        X, Y = torch.meshgrid(x, y, indexing="ij")
        grid = torch.stack([X, Y], dim=-1)
        return data[..., :self.initial_step, :], data, grid


class SpectralConv2d_fast(nn.Module):
    def __init__(self, in_channels, out_channels, modes1, modes2):
        super().__init__()
        self.modes1, self.modes2 = modes1, modes2
        self.scale = 1 / (in_channels * out_channels)
        self.weights1 = nn.Parameter(self.scale * torch.rand(in_channels, out_channels, modes1, modes2, dtype=torch.cfloat))
        self.weights2 = nn.Parameter(self.scale * torch.rand(in_channels, out_channels, modes1, modes2, dtype=torch.cfloat))

    def forward(self, x):
        b = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.weights1.shape[1], x.size(-2), x.size(-1) // 2 + 1, dtype=torch.cfloat, device=x.device)
        out_ft[:, :, :self.modes1, :self.modes2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :self.modes1, :self.modes2], self.weights1)
        out_ft[:, :, -self.modes1:, :self.modes2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -self.modes1:, :self.modes2], self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO2d(nn.Module):
    def __init__(self, num_channels, modes, width, initial_step):
        super().__init__()
        self.padding = 2
        self.fc0 = nn.Linear(initial_step * num_channels + 2, width)
        self.convs = nn.ModuleList([SpectralConv2d_fast(width, width, modes, modes) for _ in range(4)])
        self.ws = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(4)])
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, num_channels)

    def forward(self, x, grid):
        x = torch.cat((x, grid), dim=-1)
        x = self.fc0(x).permute(0, 3, 1, 2)
        x = F.pad(x, [0, self.padding, 0, self.padding])
        for i in range(4):
            x = self.convs[i](x) + self.ws[i](x)
            if i < 3:
                x = F.gelu(x)
        x = x[..., :-self.padding, :-self.padding].permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x))).unsqueeze(-2)


def autoregressive(model, xx, yy, grid, initial_step, t_end, noise=0.0):
    """Returns predictions for steps initial_step..t_end-1, shape [B, X, Y, T', C]."""
    b, X, Y = xx.shape[:3]
    preds = []
    for t in range(initial_step, t_end):
        inp = xx.reshape(b, X, Y, -1)
        if noise > 0:
            inp = inp + noise * torch.randn_like(inp)
        im = model(inp, grid)
        preds.append(im)
        xx = torch.cat((xx[..., 1:, :], im), dim=-2)
    return torch.cat(preds, dim=-2)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # different seed per rank so the augmentation noise differs between GPUs
    seed_everything(args.seed + rank)

    with h5py.File(args.file, "r") as f:
        keys = sorted(f.keys())
    perm = np.random.permutation(len(keys))
    n_val = int(args.val_frac * len(keys))
    val_keys = [keys[i] for i in perm[:n_val]]
    train_keys = [keys[i] for i in perm[n_val:]]

    train_ds = DiffReactDataset(args.file, train_keys, args.initial_step, args.reduced_t)
    val_ds = DiffReactDataset(args.file, val_keys, args.initial_step, args.reduced_t)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=args.batch_size, num_workers=2)

    model = FNO2d(2, args.modes, args.width, args.initial_step).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=args.scheduler_step, gamma=0.5)
    t_end = args.t_train // args.reduced_t

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split.txt"), "w") as fh:
            fh.write("\n".join(val_keys))
    best = float("inf")

    for ep in range(args.epochs):
        train_sampler.set_epoch(ep)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for xx, yy, grid in train_loader:
            xx, yy, grid = xx.to(device), yy.to(device), grid.to(device)
            pred = autoregressive(model, xx, yy, grid, args.initial_step, t_end, noise=args.noise)
            target = yy[..., args.initial_step:t_end, :]
            loss = F.mse_loss(pred.reshape(xx.shape[0], -1), target.reshape(xx.shape[0], -1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tr += torch.stack([loss.detach() * xx.shape[0], torch.tensor(float(xx.shape[0]), device=device)])
        sched.step()

        model.eval()
        va = torch.zeros(2, device=device)
        with torch.no_grad():
            for xx, yy, grid in val_loader:
                xx, yy, grid = xx.to(device), yy.to(device), grid.to(device)
                pred = autoregressive(model.module, xx, yy, grid, args.initial_step, t_end)
                target = yy[..., args.initial_step:t_end, :]
                b = xx.shape[0]
                nrmse = (pred - target).reshape(b, -1).norm(dim=1) / target.reshape(b, -1).norm(dim=1)
                va += torch.stack([nrmse.sum(), torch.tensor(float(b), device=device)])
        dist.all_reduce(tr)
        dist.all_reduce(va)
        if rank == 0:
            val_nrmse = (va[0] / va[1]).item()
            print(f"ep {ep:3d} {time.time() - t0:5.1f}s train mse {(tr[0] / tr[1]).item():.3e} val nRMSE {val_nrmse:.4f}",
                  flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": ep, "val": val_nrmse}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if val_nrmse < best:
                best = val_nrmse
                torch.save(ckpt, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
