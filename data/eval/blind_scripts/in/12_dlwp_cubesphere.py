"""DLWP-style U-Net on the cubed sphere (6 faces x 64 x 64), sequence-to-sequence:
inputs (t-6h, t) -> outputs (t+6h, t+12h), trained on a 24 h rollout.

    torchrun --nproc_per_node=4 --master_port=29511 12_dlwp_cubesphere.py -c dlwp_cs64.yaml
"""
import argparse
import logging
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("dlwp")


class CubeSphereSeq(Dataset):
    """Remapped ERA5 on a C64 cubed sphere: variable (time, face, height, width) per variable."""

    def __init__(self, path, variables, start, end, mean, std, n_in=2, n_out=2, rollout=2):
        ds = xr.open_zarr(path).sel(time=slice(start, end))
        self.data = ds[variables].to_array("channel").transpose("time", "channel", "face", "height", "width")
        self.const = np.stack([ds["lsm"].values, ds["z_surface"].values / 9.81 / 1000.0]).astype(np.float32)
        self.mean = mean[None, :, None, None, None]
        self.std = std[None, :, None, None, None]
        self.n_in, self.n_out, self.rollout = n_in, n_out, rollout
        self.span = n_in + n_out * rollout

    def __len__(self):
        return self.data.sizes["time"] - self.span + 1

    def __getitem__(self, i):
        seq = self.data.isel(time=slice(i, i + self.span)).values.astype(np.float32)
        seq = (seq - self.mean) / self.std
        return torch.from_numpy(seq[:self.n_in]), torch.from_numpy(seq[self.n_in:])


def face_conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GELU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GELU())


class CubeUNet(nn.Module):
    """Shared-weight U-Net applied to every face; faces are folded into the batch."""

    def __init__(self, in_ch, out_ch, n_const, base=64):
        super().__init__()
        self.e1 = face_conv(in_ch + n_const, base)
        self.e2 = face_conv(base, 2 * base)
        self.e3 = face_conv(2 * base, 4 * base)
        self.u2 = nn.Upsample(scale_factor=2)
        self.d2 = face_conv(6 * base, 2 * base)
        self.u1 = nn.Upsample(scale_factor=2)
        self.d1 = face_conv(3 * base, base)
        self.out = nn.Conv2d(base, out_ch, 1)

    def forward(self, x, const):
        # x: (B, T_in, V, 6, H, W); const: (B, K, 6, H, W)
        B, T, V, F_, H, W = x.shape
        h = torch.cat([x.reshape(B, T * V, F_, H, W), const], dim=1)
        h = h.permute(0, 2, 1, 3, 4).reshape(B * F_, -1, H, W)
        e1 = self.e1(h)
        e2 = self.e2(F.avg_pool2d(e1, 2))
        e3 = self.e3(F.avg_pool2d(e2, 2))
        d2 = self.d2(torch.cat([self.u2(e3), e2], 1))
        d1 = self.d1(torch.cat([self.u1(d2), e1], 1))
        y = self.out(d1).view(B, F_, -1, V, H, W).permute(0, 2, 3, 1, 4, 5)   # (B, T_out, V, 6, H, W)
        return y


def cell_area_weights(path, device):
    area = xr.open_zarr(path)["cell_area"].values.astype(np.float32)   # (6, 64, 64)
    w = torch.from_numpy(area / area.mean()).to(device)
    return w.view(1, 1, 1, 6, 64, 64)


def rollout(model, x_in, const, n_steps):
    outs = []
    for _ in range(n_steps):
        y = model(x_in, const)
        outs.append(y)
        x_in = y[:, -x_in.shape[1]:]
    return torch.cat(outs, dim=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    variables = cfg["variables"]
    stats = np.load(cfg["stats"])
    mean, std = stats["mean"].astype(np.float32), stats["std"].astype(np.float32)
    train_ds = CubeSphereSeq(cfg["zarr"], variables, "1979-01-01", "2012-12-31", mean, std,
                             rollout=cfg["rollout"])
    val_full = CubeSphereSeq(cfg["zarr"], variables, "2013-01-01", "2016-12-31", mean, std,
                             rollout=cfg["rollout"])
    val_ds = Subset(val_full, range(rank, len(val_full), world))

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=cfg["seed"])
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_per_gpu"], num_workers=2, pin_memory=True)

    const = torch.from_numpy(train_ds.const).to(device)
    net = CubeUNet(2 * len(variables), 2 * len(variables), const.shape[0], cfg["base_width"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / cfg["ref_batch"]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"])
    w = cell_area_weights(cfg["zarr"], device)
    std_t = torch.from_numpy(std).to(device).view(1, 1, -1, 1, 1, 1)

    ckdir = cfg["checkpoint_dir"]
    if rank == 0:
        os.makedirs(ckdir, exist_ok=True)
    best = float("inf")
    n_skipped = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x_in, y_true) in enumerate(train_dl):
            x_in = x_in.to(device, non_blocking=True)
            y_true = y_true.to(device, non_blocking=True)
            c = const.unsqueeze(0).expand(x_in.shape[0], -1, -1, -1, -1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = rollout(model, x_in, c, cfg["rollout"])
            loss = ((y.float() - y_true) ** 2 * w).mean()
            if not torch.isfinite(loss):
                # a few remapped files have missing tiles; don't let them poison Adam's moments
                n_skipped += 1
                log.warning("non-finite loss at epoch %d it %d, skipping batch", epoch, it)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            if it % 100 == 0:
                log.info("epoch %d it %d loss %.4f", epoch, it, loss.item())
        sched.step()

        net.eval()
        acc = torch.zeros(len(variables) + 1, dtype=torch.float64, device=device)
        with torch.no_grad():
            for x_in, y_true in val_dl:
                x_in, y_true = x_in.to(device), y_true.to(device)
                c = const.unsqueeze(0).expand(x_in.shape[0], -1, -1, -1, -1)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = rollout(net, x_in, c, cfg["rollout"]).float()
                # RMSE at the last lead time (24 h), in physical units
                se = ((y[:, -1] - y_true[:, -1]) * std_t[:, 0]) ** 2 * w[:, 0]
                acc[:-1] += se.mean(dim=(-3, -2, -1)).sqrt().sum(0).double()
                acc[-1] += x_in.shape[0]
        dist.all_reduce(acc)
        rmse = (acc[:-1] / acc[-1]).tolist()
        score = float(np.mean(rmse[:2]))
        if rank == 0:
            log.info("epoch %d (%.0fs) val 24h rmse %s", epoch, time.time() - t0,
                     " ".join(f"{v}={r:.3f}" for v, r in zip(variables, rmse)))
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(ckdir, "last.pt"))
            if score < best:
                torch.save(state, os.path.join(ckdir, "best.pt"))
        best = min(best, score)
        dist.barrier()

    if n_skipped:
        log.warning("skipped %d batches with non-finite loss", n_skipped)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
