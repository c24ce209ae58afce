"""0.25 deg U-Net forecasting 6 h accumulated precipitation together with the atmospheric state.

Per-GPU batch is 2 (full 720x1440 fields). 8 GPUs -> global batch 16.

    torchrun --nproc_per_node=8 13_unet025_precip.py --h5-dir /lustre/era5_h5 --out /lustre/runs/unet_tp
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

N_STATE = 24   # u10 v10 t2m sp msl + 19 pressure-level fields
TP_EPS = 1e-5


class H5Forecast(Dataset):
    def __init__(self, h5_dir, years, mean, std):
        self.files = [os.path.join(h5_dir, f"{y}.h5") for y in years]
        self.lengths = []
        for f in self.files:
            with h5py.File(f, "r") as h:
                self.lengths.append(h["fields"].shape[0] - 1)
        self.cum = np.cumsum([0] + self.lengths)
        self.mean, self.std = mean[:, None, None], std[:, None, None]
        self._open = {}

    def __len__(self):
        return int(self.cum[-1])

    def _file(self, k):
        if k not in self._open:
            self._open[k] = h5py.File(self.files[k], "r")
        return self._open[k]

    def __getitem__(self, idx):
        k = int(np.searchsorted(self.cum, idx, side="right") - 1)
        t = idx - int(self.cum[k])
        h = self._file(k)
        x = (h["fields"][t, :, :720].astype(np.float32) - self.mean) / self.std
        y = (h["fields"][t + 1, :, :720].astype(np.float32) - self.mean) / self.std
        tp = np.log(h["tp6h"][t + 1, :720].astype(np.float32) + TP_EPS) - np.log(TP_EPS)
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(tp[None])


class DoubleConv(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, cin, widths=(64, 128, 256, 512, 512)):
        super().__init__()
        self.downs = nn.ModuleList()
        c = cin
        for wd in widths:
            self.downs.append(DoubleConv(c, wd))
            c = wd
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        for wd in reversed(widths[:-1]):
            self.ups.append(nn.ConvTranspose2d(c, wd, 2, stride=2))
            self.up_convs.append(DoubleConv(2 * wd, wd))
            c = wd
        self.state_head = nn.Conv2d(c, cin, 1)
        self.tp_head = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        skips = []
        h = x
        for i, down in enumerate(self.downs):
            h = down(h)
            if i < len(self.downs) - 1:
                skips.append(h)
                h = F.max_pool2d(h, 2)
        for up, conv in zip(self.ups, self.up_convs):
            h = up(h)
            h = conv(torch.cat([h, skips.pop()], dim=1))
        return x + self.state_head(h), F.softplus(self.tp_head(h))


def lat_weights(device):
    lat = np.linspace(90, -90, 721)[:720]
    w = np.cos(np.deg2rad(lat))
    return torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)


@torch.no_grad()
def evaluate(net, loader, w, std, device):
    net.eval()
    acc = torch.zeros(N_STATE + 2, dtype=torch.float64, device=device)
    for x, y, tp in loader:
        x, y, tp = x.to(device), y.to(device), tp.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ps, ptp = net(x)
        ps, ptp = ps.float(), ptp.float()
        acc[:N_STATE] += ((((ps - y) * std) ** 2) * w).mean(dim=(-2, -1)).sqrt().sum(0).double()
        tp_mm = (torch.exp(ptp + np.log(TP_EPS)) - TP_EPS) * 1000.0
        tp_true = (torch.exp(tp + np.log(TP_EPS)) - TP_EPS) * 1000.0
        acc[N_STATE] += (((tp_mm - tp_true) ** 2) * w).mean(dim=(-3, -2, -1)).sqrt().sum().double()
        acc[-1] += x.shape[0]
    dist.all_reduce(acc)
    net.train()
    return (acc[:-1] / acc[-1]).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=2, help="per GPU")
    ap.add_argument("--lr", type=float, default=3e-4, help="for global batch 16")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--tp-weight", type=float, default=0.5)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    st = np.load(os.path.join(args.h5_dir, "stats_1979_2015.npz"))
    mean, std = st["mean"][:N_STATE].astype(np.float32), st["std"][:N_STATE].astype(np.float32)
    train_ds = H5Forecast(args.h5_dir, range(1979, 2016), mean, std)
    val_all = H5Forecast(args.h5_dir, [2016, 2017], mean, std)
    val_ds = Subset(val_all, range(rank, len(val_all), 6 * world))   # every 36 h, sharded

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    net = UNet(N_STATE).to(device).to(memory_format=torch.channels_last)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-6)

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    w = lat_weights(device)
    std_t = torch.from_numpy(std).to(device).view(1, -1, 1, 1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y, tp) in enumerate(train_dl):
            x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y, tp = y.to(device, non_blocking=True), tp.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                ps, ptp = model(x)
            loss_state = ((ps.float() - y) ** 2 * w).mean()
            loss_tp = ((ptp.float() - tp) ** 2 * w).mean()
            loss = loss_state + args.tp_weight * loss_tp
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} state {loss_state.item():.4f} "
                      f"tp {loss_tp.item():.4f}", flush=True)

        scores = evaluate(net, val_dl, w, std_t, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val z500 {scores[14]:.1f} t850 {scores[5]:.2f} "
                  f"tp6h {scores[N_STATE]:.3f} mm", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"ckpt_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
