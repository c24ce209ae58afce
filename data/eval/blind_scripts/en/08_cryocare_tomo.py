#!/usr/bin/env python
"""
cryoCARE-style denoising of cryo-ET tomograms from even/odd reconstructions.

Step 1 (extraction): sub-volumes of 72^3 are cut from the even/odd tomograms
(only where the local std is above a threshold, i.e. not in the vacuum above
/below the lamella), normalised with the global mean/std of the tomogram, and
stored in one .npz per configuration so later runs skip the extraction.
Step 2: a 3D U-Net is trained even->odd and odd->even.

    torchrun --nproc_per_node=4 08_cryocare_tomo.py --config cryocare_lamella7.json
"""
import argparse
import hashlib
import json
import logging
import os
import time

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("cryocare")

DEFAULT_CFG = {
    "even": [], "odd": [], "cache_dir": "/scratch/cryocare_cache", "model_dir": "models/cryocare",
    "patch": 72, "n_per_tomo": 1200, "min_std_frac": 0.5, "val_frac": 0.1,
    "batch_size": 4, "lr": 4e-4, "epochs": 100, "unet_depth": 3, "base": 16, "seed": 13,
}


def config_key(cfg):
    keys = ("even", "odd", "patch", "n_per_tomo", "min_std_frac", "seed")
    blob = json.dumps({k: cfg[k] for k in keys}, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


def extract_subvolumes(cfg):
    rng = np.random.default_rng(cfg["seed"])
    p = cfg["patch"]
    xs, ys = [], []
    for fe, fo in zip(cfg["even"], cfg["odd"]):
        with mrcfile.open(fe, permissive=True) as me, mrcfile.open(fo, permissive=True) as mo:
            even = me.data.astype(np.float32)
            odd = mo.data.astype(np.float32)
        mu = 0.5 * (even.mean() + odd.mean())
        sd = 0.5 * (even.std() + odd.std())
        even, odd = (even - mu) / sd, (odd - mu) / sd
        Z, Y, X = even.shape
        thr = cfg["min_std_frac"] * even.std()
        got, tries = 0, 0
        while got < cfg["n_per_tomo"] and tries < 50 * cfg["n_per_tomo"]:
            tries += 1
            z, y, x = rng.integers(0, Z - p), rng.integers(0, Y - p), rng.integers(0, X - p)
            a = even[z:z + p, y:y + p, x:x + p]
            if a.std() < thr:
                continue
            xs.append(a.copy())
            ys.append(odd[z:z + p, y:y + p, x:x + p].copy())
            got += 1
        log.info("%s: %d sub-volumes (%d tries)", os.path.basename(fe), got, tries)
    return np.stack(xs)[:, None], np.stack(ys)[:, None]


def load_or_extract(cfg):
    os.makedirs(cfg["cache_dir"], exist_ok=True)
    path = os.path.join(cfg["cache_dir"], f"subvolumes_{config_key(cfg)}.npz")
    if not os.path.exists(path):
        log.info("extracting sub-volumes -> %s", path)
        even, odd = extract_subvolumes(cfg)
        np.savez(path, even=even.astype(np.float16), odd=odd.astype(np.float16))
    d = np.load(path)
    return d["even"].astype(np.float32), d["odd"].astype(np.float32)


class UNet3D(nn.Module):
    def __init__(self, depth=3, base=16):
        super().__init__()

        def blk(i, o):
            return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.GroupNorm(4, o), nn.LeakyReLU(0.1, True),
                                 nn.Conv3d(o, o, 3, padding=1), nn.GroupNorm(4, o), nn.LeakyReLU(0.1, True))

        ch = [base * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList([blk(1 if i == 0 else ch[i - 1], ch[i]) for i in range(depth + 1)])
        self.up = nn.ModuleList([nn.ConvTranspose3d(ch[i + 1], ch[i], 2, 2) for i in reversed(range(depth))])
        self.dec = nn.ModuleList([blk(2 * ch[i], ch[i]) for i in reversed(range(depth))])
        self.out = nn.Conv3d(ch[0], 1, 1)

    def forward(self, x):
        skips = []
        h = x
        for i, d in enumerate(self.down):
            h = d(h if i == 0 else F.max_pool3d(h, 2))
            skips.append(h)
        skips.pop()
        for u, d in zip(self.up, self.dec):
            h = d(torch.cat([u(h), skips.pop()], 1))
        return x + self.out(h)


def augment(a, b):
    # random 90 deg rotation in XY and random swap of the N2N direction
    k = int(torch.randint(4, (1,)))
    a, b = torch.rot90(a, k, (3, 4)), torch.rot90(b, k, (3, 4))
    if torch.rand(1).item() < 0.5:
        a, b = b, a
    return a, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = dict(DEFAULT_CFG)
    with open(ap.parse_args().config) as fh:
        cfg.update(json.load(fh))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(message)s")

    even, odd = load_or_extract(cfg)
    n = len(even)
    perm = np.random.default_rng(cfg["seed"]).permutation(n)
    n_val = int(cfg["val_frac"] * n)
    tr_idx, va_idx = perm[n_val:], perm[:n_val]
    train_ds = TensorDataset(torch.from_numpy(even[tr_idx]), torch.from_numpy(odd[tr_idx]))
    val_ds = TensorDataset(torch.from_numpy(even[va_idx]), torch.from_numpy(odd[va_idx]))

    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=tr_sampler, drop_last=True,
                       num_workers=2, pin_memory=True)
    va_dl = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=va_sampler, num_workers=2)

    model = DDP(UNet3D(cfg["unet_depth"], cfg["base"]).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"] * world)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=5)

    os.makedirs(cfg["model_dir"], exist_ok=True)
    best = float("inf")
    for epoch in range(cfg["epochs"]):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=dev)
        for a, b in tr_dl:
            a, b = augment(a.to(dev, non_blocking=True), b.to(dev, non_blocking=True))
            loss = F.mse_loss(model(a), b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=dev)])

        model.eval()
        val = torch.zeros(2, device=dev)
        with torch.no_grad():
            for a, b in va_dl:
                a, b = a.to(dev), b.to(dev)
                val += torch.stack([F.mse_loss(model.module(a), b) * a.shape[0],
                                    torch.tensor(float(a.shape[0]), device=dev)])
        dist.all_reduce(run)
        dist.all_reduce(val)
        tr_loss, va_loss = (run[0] / run[1]).item(), (val[0] / val[1]).item()
        sched.step(va_loss)

        if rank == 0:
            log.info("epoch %d  train %.4f  val %.4f  lr %.1e  %.0fs", epoch, tr_loss, va_loss,
                     opt.param_groups[0]["lr"], time.time() - t0)
            if va_loss < best:
                best = va_loss
                torch.save({"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch},
                           os.path.join(cfg["model_dir"], "cryocare_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
