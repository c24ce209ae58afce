"""ViT forecaster on 1.40625 deg ERA5 (128 x 256) with an optional diagnostic
total-precipitation head, in the spirit of FourCastNet's precip model.

The prognostic state is advanced one 6 h step; tp6h is diagnosed from the
predicted state by a small conv head and trained with a log-transformed target.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STATE_VARS = ["z500", "t850", "t2m", "u10", "v10", "msl", "q700", "u500", "v500", "t500", "z250", "tcwv"]
TP_EPS = 1e-5


class WeatherBenchPairs(Dataset):
    def __init__(self, root, years, mean, std, lead=1):
        files = [f"{root}/{y}.nc" for y in years]
        ds = xr.open_mfdataset(files, combine="by_coords")
        self.state = ds[STATE_VARS].to_array("var").transpose("time", "var", "lat", "lon")
        self.tp = ds["tp6h"].transpose("time", "lat", "lon")
        self.mean = mean[:, None, None]
        self.std = std[:, None, None]
        self.lead = lead

    def __len__(self):
        return self.state.sizes["time"] - self.lead

    def __getitem__(self, i):
        x = (self.state.isel(time=i).values - self.mean) / self.std
        y = (self.state.isel(time=i + self.lead).values - self.mean) / self.std
        tp = np.log1p(self.tp.isel(time=i + self.lead).values / TP_EPS)
        return (torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.float32)),
                torch.from_numpy(tp.astype(np.float32))[None])


class ViTForecaster(nn.Module):
    def __init__(self, n_vars, img=(128, 256), patch=4, dim=768, depth=12, heads=12):
        super().__init__()
        self.patch, self.n_vars = patch, n_vars
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(n_vars, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, self.gh * self.gw, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_vars * patch * patch)
        # diagnostic precipitation from the predicted state
        self.precip_head = nn.Sequential(
            nn.Conv2d(n_vars, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, 1, 1), nn.ReLU(),
        )

    def unpatchify(self, t):
        B = t.shape[0]
        p = self.patch
        t = t.view(B, self.gh, self.gw, p, p, self.n_vars).permute(0, 5, 1, 3, 2, 4)
        return t.reshape(B, self.n_vars, self.gh * p, self.gw * p)

    def forward(self, x, diagnose_precip=False):
        tok = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        tok = self.norm(self.encoder(tok))
        nxt = x + self.unpatchify(self.head(tok))
        if diagnose_precip:
            return nxt, self.precip_head(nxt)
        return nxt, None


def area_weights(n_lat, device):
    lat = torch.linspace(-90 + 180 / n_lat / 2, 90 - 180 / n_lat / 2, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, n_lat, 1)


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/gpfs/wx/weatherbench/1.40625deg_6h")
    ap.add_argument("--stats", default="/gpfs/wx/weatherbench/stats_1979_2015.npz")
    ap.add_argument("--save_dir", default="/gpfs/wx/runs/vit_tp")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--train_precip", action="store_true", help="also fit the diagnostic tp head")
    ap.add_argument("--tp_weight", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    st = np.load(args.stats)
    mean = np.array([st[v][0] for v in STATE_VARS], dtype=np.float32)
    std = np.array([st[v][1] for v in STATE_VARS], dtype=np.float32)

    train_ds = WeatherBenchPairs(args.root, range(1979, 2016), mean, std)
    val_ds = WeatherBenchPairs(args.root, [2016], mean, std)
    val_ds = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, shuffle=False, num_workers=4, pin_memory=True)

    net = ViTForecaster(len(STATE_VARS)).to(device)
    net = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / total))
    aw = area_weights(128, device)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        for i, (x, y, tp) in enumerate(train_dl):
            x, y, tp = x.to(device, non_blocking=True), y.to(device, non_blocking=True), tp.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred, tp_pred = net(x, diagnose_precip=args.train_precip)
                loss = (aw * (pred.float() - y) ** 2).mean()
                if tp_pred is not None:
                    loss = loss + args.tp_weight * (aw * (tp_pred.float() - tp) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

        # validation: latitude-weighted RMSE per variable in physical units
        net.eval()
        sums = torch.zeros(len(STATE_VARS) + 1, device=device, dtype=torch.float64)
        std_t = torch.as_tensor(std, device=device).view(1, -1, 1, 1)
        with torch.no_grad():
            for x, y, _ in val_dl:
                x, y = x.to(device), y.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred, _ = net.module(x)
                mse = (aw * ((pred.float() - y) * std_t) ** 2).mean(dim=(-2, -1))
                sums[:-1] += mse.sum(0).double()
                sums[-1] += x.shape[0]
        dist.all_reduce(sums)
        rmse = torch.sqrt(sums[:-1] / sums[-1])
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " +
                  " ".join(f"{v}:{r:.3f}" for v, r in zip(STATE_VARS, rmse.tolist())), flush=True)
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "mean": mean, "std": std}, os.path.join(args.save_dir, "last.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
