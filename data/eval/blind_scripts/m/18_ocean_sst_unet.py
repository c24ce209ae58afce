"""
Monthly sea-surface-temperature emulator trained on a CMIP6 historical run (regridded to 1 deg,
180 x 360). Input: SST anomaly of the last 3 months + ocean mask + month encoding,
target: SST anomaly 1 month ahead. Land points are masked out of the loss.

Data prepared with xarray into a single zarr -> exported to sst_anom.npy (T, 180, 360) float32,
NaN on land, plus months.npy (T,).

    torchrun --nproc_per_node=4 18_ocean_sst_unet.py --data_dir /work/cmip6/cesm2_hist
"""
import argparse
import os
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

N_HIST = 3


class SSTWindows(Dataset):
    def __init__(self, sst, months, t_indices):
        self.sst = sst
        self.months = months
        self.t = t_indices
        self.mask = ~np.isnan(sst[0])
        self.sst_filled = np.nan_to_num(sst, nan=0.0)

    def __len__(self):
        return len(self.t)

    def __getitem__(self, i):
        t = self.t[i]
        hist = self.sst_filled[t - N_HIST:t]
        m = self.months[t]
        month_enc = np.stack([np.full(self.mask.shape, np.sin(2 * np.pi * m / 12)),
                              np.full(self.mask.shape, np.cos(2 * np.pi * m / 12))])
        x = np.concatenate([hist, self.mask[None].astype(np.float32), month_enc]).astype(np.float32)
        y = self.sst_filled[t][None].astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(y)


def down(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, padding_mode="circular"), nn.GroupNorm(8, cout), nn.GELU(),
                         nn.Conv2d(cout, cout, 3, padding=1, padding_mode="circular"), nn.GroupNorm(8, cout), nn.GELU())


class SSTUNet(nn.Module):
    def __init__(self, cin=N_HIST + 3, base=48):
        super().__init__()
        self.e1 = down(cin, base)
        self.e2 = down(base, base * 2)
        self.e3 = down(base * 2, base * 4)
        self.mid = down(base * 4, base * 4)
        self.d3 = down(base * 8, base * 2)
        self.d2 = down(base * 4, base)
        self.d1 = down(base * 2, base)
        self.head = nn.Conv2d(base, 1, 1)

    def forward(self, x):
        e1 = self.e1(x)                       # 180 x 360
        e2 = self.e2(F.max_pool2d(e1, 2))     # 90 x 180
        e3 = self.e3(F.max_pool2d(e2, 2))     # 45 x 90
        m = self.mid(e3)
        d3 = self.d3(torch.cat([m, e3], 1))
        d2 = self.d2(torch.cat([F.interpolate(d3, size=e2.shape[-2:]), e2], 1))
        d1 = self.d1(torch.cat([F.interpolate(d2, size=e1.shape[-2:]), e1], 1))
        return x[:, N_HIST - 1:N_HIST] + self.head(d1)


def masked_mse(pred, y, mask, w):
    return (((pred - y) ** 2) * mask * w).sum() / (mask * w).sum().clamp(min=1.0) / pred.shape[0]


def plot_example(x, y, pred, mask, path):
    fig, axs = plt.subplots(1, 3, figsize=(15, 3.5))
    for ax, arr, title in zip(axs, [y, pred, pred - y], ["target", "prediction", "error"]):
        arr = np.where(mask, arr, np.nan)
        im = ax.imshow(arr, origin="lower", cmap="RdBu_r", vmin=-3, vmax=3)
        ax.set_title(title)
        fig.colorbar(im, ax=ax, shrink=0.7)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--val_years", type=int, default=15)
    ap.add_argument("--out", default="runs/sst_unet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sst = np.load(os.path.join(args.data_dir, "sst_anom.npy"), mmap_mode="r")
    sst = np.asarray(sst, dtype=np.float32)
    months = np.load(os.path.join(args.data_dir, "months.npy"))
    T = len(sst)
    n_val = 12 * args.val_years
    train_t = np.arange(N_HIST, T - n_val)
    val_t = np.arange(T - n_val, T)

    train_ds = SSTWindows(sst, months, train_t)
    val_ds = SSTWindows(sst, months, val_t[rank::world])
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, shuffle=False, num_workers=2)

    mask = torch.from_numpy(train_ds.mask.astype(np.float32)).to(device)[None, None]
    lat = np.linspace(-89.5, 89.5, 180)
    w = torch.from_numpy(np.cos(np.deg2rad(lat)).astype(np.float32)).to(device).view(1, 1, -1, 1)

    model = DDP(SSTUNet().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    if rank == 0:
        os.makedirs(os.path.join(args.out, "figs"), exist_ok=True)
        csv = open(os.path.join(args.out, "metrics.csv"), "w")
        csv.write("epoch,train_mse,val_rmse,persistence_rmse,sec\n")

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = masked_mse(model(x), y, mask, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tr)

        net = model.module
        net.eval()
        ev = torch.zeros(3, device=device)  # sum sq err model, sum sq err persistence, weight sum
        with torch.no_grad():
            for x, y in val_dl:
                x, y = x.to(device), y.to(device)
                p = net(x)
                ev[0] += (((p - y) ** 2) * mask * w).sum()
                ev[1] += (((x[:, N_HIST - 1:N_HIST] - y) ** 2) * mask * w).sum()
                ev[2] += (mask * w).sum() * x.shape[0]
        dist.all_reduce(ev)
        val_rmse = torch.sqrt(ev[0] / ev[2]).item()
        pers_rmse = torch.sqrt(ev[1] / ev[2]).item()

        if rank == 0:
            dt = time.time() - t0
            print(f"epoch {epoch:3d}  train {(tr[0] / tr[1]).item():.5f}  val RMSE {val_rmse:.4f} K "
                  f"(persistence {pers_rmse:.4f})  {dt:.0f}s", flush=True)
            csv.write(f"{epoch},{(tr[0] / tr[1]).item():.6f},{val_rmse:.5f},{pers_rmse:.5f},{dt:.1f}\n")
            csv.flush()
            if epoch % 10 == 0:
                plot_example(x[0, N_HIST - 1].cpu().numpy(), y[0, 0].cpu().numpy(), p[0, 0].cpu().numpy(),
                             train_ds.mask, os.path.join(args.out, "figs", f"ep{epoch:03d}.png"))
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.out, "sst_unet.pt"))
        dist.barrier()

    if rank == 0:
        csv.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
