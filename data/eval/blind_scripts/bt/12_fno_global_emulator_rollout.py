"""Global FNO emulator at 5.625 deg with TOA-radiation forcing; multi-step training.

The model maps (state_t, forcing_t) -> state_{t+6h}. Training unrolls `--train-steps`
steps with gradients through the whole rollout; validation rolls out 5 days and
reports latitude-weighted RMSE / ACC for z500 and t850.

    torchrun --standalone --nproc_per_node=4 12_fno_global_emulator_rollout.py \
        --train-h5 /data/wb/train_1979_2014.h5 --val-h5 /data/wb/val_2016.h5 \
        --clim /data/wb/clim_1979_2014.npy --out runs/fno_global
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

Z500, T850 = 0, 1  # channel order in the h5 files: z500, t850, t2m, u10, v10, q700


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-h5", required=True)
    p.add_argument("--val-h5", required=True)
    p.add_argument("--clim", required=True)
    p.add_argument("--out", default="runs/fno_global")
    p.add_argument("--modes", type=int, default=16)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--val-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=60)
    return p.parse_args()


class Trajectories(Dataset):
    def __init__(self, path, steps):
        self.path, self.steps = path, steps
        with h5py.File(path, "r") as f:
            self.T = f["data"].shape[0]
            self.mean = f["data"].attrs["mean"].astype(np.float32)[:, None, None]
            self.std = f["data"].attrs["std"].astype(np.float32)[:, None, None]
        self.f = None

    def __len__(self):
        return self.T - self.steps

    def __getitem__(self, t):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        x = (self.f["data"][t:t + self.steps + 1] - self.mean) / self.std        # (S+1, C, 32, 64)
        forcing = self.f["forcing"][t:t + self.steps]                              # (S, 1, 32, 64)
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(forcing.astype(np.float32))


class SpectralConv(nn.Module):
    def __init__(self, width, modes):
        super().__init__()
        self.modes = modes
        s = 1.0 / (width * width)
        self.w_pos = nn.Parameter(s * torch.randn(width, width, modes, modes, dtype=torch.cfloat))
        self.w_neg = nn.Parameter(s * torch.randn(width, width, modes, modes, dtype=torch.cfloat))

    def forward(self, x):
        B, C, H, W = x.shape
        m = self.modes
        xf = torch.fft.rfft2(x.float(), norm="ortho")
        out = torch.zeros(B, C, H, W // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], self.w_pos)
        out[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -m:, :m], self.w_neg)
        return torch.fft.irfft2(out, s=(H, W), norm="ortho")


class FNOEmulator(nn.Module):
    def __init__(self, n_vars=6, n_forcing=1, width=128, modes=16, layers=6):
        super().__init__()
        self.lift = nn.Conv2d(n_vars + n_forcing + 2, width, 1)
        self.spec = nn.ModuleList(SpectralConv(width, modes) for _ in range(layers))
        self.skip = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.norms = nn.ModuleList(nn.GroupNorm(1, width) for _ in range(layers))
        self.proj = nn.Sequential(nn.Conv2d(width, 256, 1), nn.GELU(), nn.Conv2d(256, n_vars, 1))
        lat = torch.linspace(-1, 1, 32).view(32, 1).expand(32, 64)
        lon = torch.linspace(0, 2 * np.pi, 65)[:-1].view(1, 64).expand(32, 64)
        self.register_buffer("coords", torch.stack([lat, torch.sin(lon)])[None])

    def forward(self, x, forcing):
        h = self.lift(torch.cat([x, forcing, self.coords.expand(x.shape[0], -1, -1, -1)], dim=1))
        for spec, skip, norm in zip(self.spec, self.skip, self.norms):
            h = h + F.gelu(norm(spec(h) + skip(h)))
        return x + self.proj(h)

    @torch.no_grad()
    def rollout(self, x0, forcings):
        preds, x = [], x0
        for k in range(forcings.shape[1]):
            x = self.forward(x, forcings[:, k])
            preds.append(x)
        return torch.stack(preds, dim=1)


def lat_weights(device):
    lat = torch.linspace(-87.1875, 87.1875, 32, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, 32, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_ds = Trajectories(args.train_h5, args.train_steps)
    val_ds = Trajectories(args.val_h5, args.val_steps)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True,
                              drop_last=True)
    val_starts = list(range(0, len(val_ds), 10))
    val_loader = DataLoader(Subset(val_ds, val_starts[rank::world]), batch_size=8, num_workers=2)

    model = FNOEmulator(width=args.width, modes=args.modes, layers=args.layers).to(dev)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    w = lat_weights(dev)
    clim = torch.from_numpy(np.load(args.clim).astype(np.float32)).to(dev)  # (C, 32, 64), normalised units
    std = torch.from_numpy(val_ds.std).to(dev)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    first = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        first = ck["epoch"] + 1

    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=dev)
        for traj, forcing in train_loader:
            traj, forcing = traj.to(dev, non_blocking=True), forcing.to(dev, non_blocking=True)
            x, loss = traj[:, 0], 0.0
            for k in range(args.train_steps):
                x = model(x, forcing[:, k])
                loss = loss + (w * (x - traj[:, k + 1]) ** 2).mean()
            loss = loss / args.train_steps
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=dev)])
        sched.step()

        model.eval()
        sse = torch.zeros(args.val_steps, 2, device=dev)
        acc_num = torch.zeros(args.val_steps, 2, device=dev)
        acc_den = torch.zeros(args.val_steps, 2, 2, device=dev)
        with torch.no_grad():
            for traj, forcing in val_loader:
                traj, forcing = traj.to(dev), forcing.to(dev)
                preds = model.rollout(traj[:, 0], forcing)[:, :, [Z500, T850]]  # (B, S, 2, H, W)
                truth = traj[:, 1:, [Z500, T850]]
                sse += (w * (preds - truth) ** 2).mean(dim=(-1, -2)).sum(0)
                pa, ta = preds - clim[[Z500, T850]], truth - clim[[Z500, T850]]
                acc_num += (w * pa * ta).mean(dim=(-1, -2)).sum(0)
                acc_den[..., 0] += (w * pa ** 2).mean(dim=(-1, -2)).sum(0)
                acc_den[..., 1] += (w * ta ** 2).mean(dim=(-1, -2)).sum(0)
        n = torch.tensor([float(len(val_loader.dataset))], device=dev)
        for t in (tr, sse, acc_num, acc_den, n):
            dist.all_reduce(t)
        rmse = torch.sqrt(sse / n) * std[[Z500, T850], 0, 0]
        acc = acc_num / torch.sqrt(acc_den[..., 0] * acc_den[..., 1])

        if rank == 0:
            d3, d5 = 11, args.val_steps - 1
            print(f"epoch {epoch:3d} | {time.time() - t0:.0f}s | train {(tr[0] / tr[1]).item():.4f} | "
                  f"z500 RMSE d3 {rmse[d3, 0]:.0f} d5 {rmse[d5, 0]:.0f} ACC d5 {acc[d5, 0]:.3f} | "
                  f"t850 RMSE d3 {rmse[d3, 1]:.2f} d5 {rmse[d5, 1]:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
