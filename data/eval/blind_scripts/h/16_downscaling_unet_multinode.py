#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""
Statistisches Downscaling ERA5 (0.25 Grad) -> COSMO-REA6 (6 km) für T2m und Niederschlag.
UNet mit GroupNorm, Residuum auf bilinear interpoliertem Input.

Start auf 2 Knoten à 4 GPUs (JUWELS Booster, je Knoten einmal ausführen):

    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=4 \
        --master_addr=$MASTER_ADDR --master_port=29500 \
        16_downscaling_unet_multinode.py --cfg cfg/downscale_t2m_tp.yaml
"""
import argparse
import logging
import os
import time
from collections import OrderedDict

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

log = logging.getLogger("downscaling")


class DownscalingPairs(Dataset):
    def __init__(self, coarse_zarr, fine_zarr, years, in_vars, out_vars, stats):
        lo = xr.open_zarr(coarse_zarr).sel(time=slice(str(years[0]), str(years[-1])))
        hi = xr.open_zarr(fine_zarr).sel(time=slice(str(years[0]), str(years[-1])))
        self.lo = lo[in_vars].to_array("var").transpose("time", "var", "lat", "lon")
        self.hi = hi[out_vars].to_array("var").transpose("time", "var", "y", "x")
        self.in_mu = np.array([stats[v]["mean"] for v in in_vars], dtype=np.float32)[:, None, None]
        self.in_sd = np.array([stats[v]["std"] for v in in_vars], dtype=np.float32)[:, None, None]
        self.out_mu = np.array([stats[v]["mean"] for v in out_vars], dtype=np.float32)[:, None, None]
        self.out_sd = np.array([stats[v]["std"] for v in out_vars], dtype=np.float32)[:, None, None]

    def __len__(self):
        return self.lo.sizes["time"]

    def __getitem__(self, i):
        x = (self.lo.isel(time=i).values.astype(np.float32) - self.in_mu) / self.in_sd
        y = (self.hi.isel(time=i).values.astype(np.float32) - self.out_mu) / self.out_sd
        return torch.from_numpy(np.nan_to_num(x)), torch.from_numpy(np.nan_to_num(y))


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class DownscaleUNet(nn.Module):
    def __init__(self, cin, cout, out_hw, base=64):
        super().__init__()
        self.out_hw = out_hw
        self.d1, self.d2, self.d3 = block(cin, base), block(base, 2 * base), block(2 * base, 4 * base)
        self.mid = block(4 * base, 8 * base)
        self.u3, self.u2, self.u1 = block(12 * base, 4 * base), block(6 * base, 2 * base), block(3 * base, base)
        self.head = nn.Conv2d(base, cout, 1)
        self.skip = nn.Conv2d(cin, cout, 1)

    def forward(self, x):
        x = F.interpolate(x, size=self.out_hw, mode="bilinear", align_corners=False)
        s1 = self.d1(x)
        s2 = self.d2(F.avg_pool2d(s1, 2))
        s3 = self.d3(F.avg_pool2d(s2, 2))
        m = self.mid(F.avg_pool2d(s3, 2))
        h = self.u3(torch.cat([F.interpolate(m, size=s3.shape[-2:]), s3], 1))
        h = self.u2(torch.cat([F.interpolate(h, size=s2.shape[-2:]), s2], 1))
        h = self.u1(torch.cat([F.interpolate(h, size=s1.shape[-2:]), s1], 1))
        return self.head(h) + self.skip(x)


class MetricAccumulator:
    """Summen für RMSE / Bias je Zielvariable."""

    def __init__(self, names):
        self.names = names
        self.sums = OrderedDict((f"{k}_{n}", 0.0) for n in names for k in ("sse", "bias"))
        self.sums["count"] = 0.0

    def update(self, pred, target, out_sd):
        err = ((pred - target) * out_sd).double()
        for j, n in enumerate(self.names):
            self.sums[f"sse_{n}"] += err[:, j].pow(2).mean(dim=(1, 2)).sum().item()
            self.sums[f"bias_{n}"] += err[:, j].mean(dim=(1, 2)).sum().item()
        self.sums["count"] += pred.shape[0]

    def reduce(self):
        t = torch.tensor(list(self.sums.values()), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        total = dict(zip(self.sums.keys(), t.tolist()))
        out = {}
        for n in self.names:
            out[f"rmse_{n}"] = (total[f"sse_{n}"] / total["count"]) ** 0.5
            out[f"bias_{n}"] = total[f"bias_{n}"] / total["count"]
        return out


@torch.no_grad()
def validate(model, loader, out_vars, out_sd, device):
    model.eval()
    acc = MetricAccumulator(out_vars)
    sd = torch.as_tensor(out_sd, device=device).view(1, -1, 1, 1)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x)
        acc.update(pred.float(), y, sd)
    return acc.reduce()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    stats = yaml.safe_load(open(cfg["stats_file"]))
    in_vars, out_vars = cfg["in_vars"], cfg["out_vars"]
    train_ds = DownscalingPairs(cfg["coarse"], cfg["fine"], cfg["train_years"], in_vars, out_vars, stats)
    val_ds = DownscalingPairs(cfg["coarse"], cfg["fine"], cfg["val_years"], in_vars, out_vars, stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler, num_workers=6)

    model = DownscaleUNet(len(in_vars), len(out_vars), tuple(cfg["out_hw"]), cfg["base"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * len(train_dl), eta_min=1e-6)
    log.info("Welt: %d Prozesse, globale Batchgröße %d", world, cfg["batch_size"] * world)

    best = float("inf")
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = F.l1_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        metrics = validate(model, val_dl, out_vars, val_ds.out_sd.squeeze(), device)
        log.info("Epoche %3d | L1 %.4f | %s | %.0fs", epoch, (run[0] / run[1]).item(),
                 " ".join(f"{k}={v:.3f}" for k, v in metrics.items()), time.time() - t0)
        score = metrics[f"rmse_{out_vars[0]}"]
        if rank == 0 and score < best:
            best = score
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(cfg["out_dir"], "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
