"""DLWP-HPX-lite: U-Net on the 12 HEALPix faces (nside=64, ~1 deg), with two input
states (t-6h, t) mapped to two output states (t+6h, t+12h) and trained on a
24 h autoregressive loss, as in Karlbauer et al. (2023).

HEALPix cells have equal area, so the verification metrics need no latitude weights.
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
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PROGNOSTIC = ["z500", "tau300-700", "z1000", "t2m0", "tcwv0", "t850", "z250", "ws10"]
CONSTANTS = ["lsm", "z"]


class HPXSequence(Dataset):
    """Samples of 2 input states + `n_out` target states on the (face, height, width) HEALPix layout."""

    def __init__(self, zarr, start, end, n_out, mean, std, toa_key="tisr"):
        ds = xr.open_zarr(zarr).sel(time=slice(start, end))
        self.x = ds["inputs"].sel(channel_in=PROGNOSTIC).transpose("time", "face", "channel_in", "height", "width")
        self.toa = ds[toa_key].transpose("time", "face", "height", "width")
        self.const = ds["constants"].sel(channel_c=CONSTANTS).transpose("face", "channel_c", "height", "width").values
        self.mu = mean[None, :, None, None].astype(np.float32)
        self.sd = std[None, :, None, None].astype(np.float32)
        self.n_out = n_out

    def __len__(self):
        return self.x.sizes["time"] - 1 - self.n_out

    def __getitem__(self, i):
        sl = slice(i, i + 2 + self.n_out)
        x = (self.x.isel(time=sl).values - self.mu) / self.sd        # T, F, C, H, W
        toa = self.toa.isel(time=sl).values[:, :, None] / 1.2e6       # T, F, 1, H, W
        return (torch.from_numpy(x.astype(np.float32)), torch.from_numpy(toa.astype(np.float32)),
                torch.from_numpy(self.const.astype(np.float32)))


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GELU(), nn.Conv2d(cout, cout, 3, padding=1), nn.GELU())


class FaceUNet(nn.Module):
    """Shared-weight U-Net applied to every HEALPix face (faces are folded into the batch)."""

    def __init__(self, n_prog, n_const, base=64):
        super().__init__()
        cin = 2 * (n_prog + 1) + n_const
        self.n_prog = n_prog
        self.enc1 = conv_block(cin, base)
        self.enc2 = conv_block(base, 2 * base)
        self.enc3 = conv_block(2 * base, 4 * base)
        self.up2 = nn.ConvTranspose2d(4 * base, 2 * base, 2, 2)
        self.dec2 = conv_block(4 * base, 2 * base)
        self.up1 = nn.ConvTranspose2d(2 * base, base, 2, 2)
        self.dec1 = conv_block(2 * base, base)
        self.out = nn.Conv2d(base, 2 * n_prog, 1)

    def forward(self, x2, toa2, const):
        # x2: B, 2, F, C, H, W ; toa2: B, 2, F, 1, H, W ; const: B, F, Cc, H, W
        B, _, Fc, C, H, W = x2.shape
        inp = torch.cat([x2[:, 0], toa2[:, 0], x2[:, 1], toa2[:, 1], const], dim=2).flatten(0, 1)
        e1 = self.enc1(inp)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(e3), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        out = self.out(d1).view(B, Fc, 2, C, H, W).transpose(1, 2)
        return x2[:, 1:2] + out  # residual w.r.t. the latest state


def step_24h(model, x, toa, const):
    """Two applications of the 2-in/2-out model: targets at +6, +12, +18, +24 h."""
    s = x[:, 0:2]
    outs = []
    for k in range(2):
        s = model(s, toa[:, 2 * k: 2 * k + 2], const)
        outs.append(s)
    return torch.cat(outs, dim=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/dlwp_hpx64.yaml")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    st = np.load(cfg["stats"])
    mean = np.array([st["mean"][list(st["names"]).index(v)] for v in PROGNOSTIC])
    std = np.array([st["std"][list(st["names"]).index(v)] for v in PROGNOSTIC])
    train_ds = HPXSequence(cfg["zarr"], cfg["train_start"], cfg["train_end"], 4, mean, std)
    val_ds = HPXSequence(cfg["zarr"], cfg["val_start"], cfg["val_end"], 20, mean, std)
    val_ds = torch.utils.data.Subset(val_ds, list(range(0, len(val_ds), 4))[rank::world])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=4, num_workers=4, pin_memory=True)

    model = DDP(FaceUNet(len(PROGNOSTIC), len(CONSTANTS)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * len(train_dl), eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    zi, ti = PROGNOSTIC.index("z500"), PROGNOSTIC.index("t850")
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    best = float("inf")

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, toa, const) in enumerate(train_dl):
            x, toa, const = x.to(device, non_blocking=True), toa.to(device, non_blocking=True), const.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = step_24h(model, x, toa, const)
            loss = F.mse_loss(pred.float(), x[:, 2:6])
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f} scale {scaler.get_scale():.0f}",
                      flush=True)

        # 5-day forecasts (10 applications of the 2-in/2-out model), RMSE at day 5
        model.eval()
        sse_z, sse_t, n = 0.0, 0.0, 0
        with torch.no_grad():
            for x, toa, const in val_dl:
                x, toa, const = x.to(device), toa.to(device), const.to(device)
                s = x[:, 0:2]
                for k in range(10):
                    with torch.autocast("cuda", dtype=torch.float16):
                        s = model.module(s, toa[:, 2 * k: 2 * k + 2], const).float()
                err = (s[:, 1] - x[:, 21]) ** 2                   # +120 h
                sse_z += err[:, :, zi].mean(dim=(1, 2, 3)).sum().item() * std[zi] ** 2
                sse_t += err[:, :, ti].mean(dim=(1, 2, 3)).sum().item() * std[ti] ** 2
                n += x.shape[0]
        totals = torch.tensor([sse_z, sse_t, n], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        rmse_z, rmse_t = (totals[:2] / totals[2]).sqrt().tolist()

        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) day-5 RMSE z500 {rmse_z:.1f} m2/s2 t850 {rmse_t:.2f} K",
                  flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
            if rmse_z < best:
                best = rmse_z
                torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
