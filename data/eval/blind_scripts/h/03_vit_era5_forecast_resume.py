#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""
ViT-based medium-range forecaster on 1.40625 deg ERA5 (ClimaX-lite), 6h lead.

Launched on the cluster as (see slurm/train_vit_era5.sbatch):

    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=32
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        03_vit_era5_forecast_resume.py --cfg configs/vit_era5_6h.yaml

Jobs are preempted after 24h, so the script always resumes from <out>/latest.pt.
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("era5")

VARS = ["z500", "t850", "t2m", "u10", "v10", "msl", "q700", "u500", "v500", "tp6h"]


class ERA5Pairs(Dataset):
    """Normalised fields stored as a (T, C, H, W) float16 memmap plus timestamps."""

    def __init__(self, root, years, lead_steps=1):
        self.arrays, self.index = [], []
        for y in years:
            arr = np.load(os.path.join(root, f"era5_{y}.npy"), mmap_mode="r")
            self.arrays.append(arr)
            self.index += [(len(self.arrays) - 1, t) for t in range(arr.shape[0] - lead_steps)]
        self.lead = lead_steps

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        a, t = self.index[i]
        arr = self.arrays[a]
        x = torch.from_numpy(np.ascontiguousarray(arr[t])).float()
        y = torch.from_numpy(np.ascontiguousarray(arr[t + self.lead])).float()
        return x, y


class ViTForecaster(nn.Module):
    def __init__(self, channels, img_size=(128, 256), patch=4, dim=768, depth=12, heads=12):
        super().__init__()
        self.patch, self.img_size, self.channels = patch, img_size, channels
        self.n_patches = (img_size[0] // patch) * (img_size[1] // patch)
        self.embed = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, self.n_patches, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, channels * patch * patch)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        B, C, H, W = x.shape
        tok = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        tok = self.norm(self.blocks(tok))
        out = self.head(tok)                                  # B, N, C*p*p
        h, w, p = H // self.patch, W // self.patch, self.patch
        out = out.view(B, h, w, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
        return x + out                                        # residual (tendency) prediction


def lat_weights(n_lat, device):
    lat = torch.linspace(-90 + 90 / n_lat, 90 - 90 / n_lat, n_lat, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def save_checkpoint(path, model, opt, sched, epoch, step, best):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "epoch": epoch, "step": step, "best": best}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, model, opt, sched):
    state = torch.load(path)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state["epoch"], state["step"], state["best"]


@torch.no_grad()
def validate(model, loader, w_lat, device):
    model.eval()
    sq = torch.zeros(len(VARS), device=device)
    n = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x)
        err = (pred.float() - y) ** 2 * w_lat
        sq += err.mean(dim=(2, 3)).sum(dim=0)
        n += x.shape[0]
    dist.all_reduce(sq)
    dist.all_reduce(n)
    return torch.sqrt(sq / n).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    train_ds = ERA5Pairs(cfg["data_root"], cfg["train_years"], cfg["lead_steps"])
    val_ds = ERA5Pairs(cfg["data_root"], cfg["val_years"], cfg["lead_steps"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    bs = cfg["global_batch"] // world
    train_loader = DataLoader(train_ds, batch_size=bs, sampler=train_sampler, num_workers=8,
                              pin_memory=True, persistent_workers=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=bs, sampler=val_sampler, num_workers=8, pin_memory=True)

    torch.manual_seed(cfg["seed"])
    model = ViTForecaster(len(VARS), tuple(cfg["img_size"]), cfg["patch"], cfg["dim"],
                          cfg["depth"], cfg["heads"]).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.05)
    total_steps = cfg["epochs"] * len(train_loader)
    warmup = cfg["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    start_epoch, step, best = 0, 0, float("inf")
    latest = os.path.join(out_dir, "latest.pt")
    if os.path.exists(latest):
        start_epoch, step, best = load_checkpoint(latest, model, opt, sched)
        start_epoch += 1
        log.info("resumed from %s at epoch %d (step %d)", latest, start_epoch, step)

    w_lat = lat_weights(cfg["img_size"][0], device)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, loss_acc = time.time(), torch.zeros(1, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x)
            loss = ((pred.float() - y) ** 2 * w_lat).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            loss_acc += loss.detach()
            if step % cfg["log_every"] == 0:
                dist.all_reduce(loss_acc)
                log.info("ep %d step %d loss %.5f lr %.2e (%.2f it/s)", epoch, step,
                         loss_acc.item() / (world * cfg["log_every"]), sched.get_last_lr()[0],
                         cfg["log_every"] / (time.time() - t0))
                loss_acc.zero_()
                t0 = time.time()

        rmse = validate(model, val_loader, w_lat, device)
        score = rmse[VARS.index("z500")].item()
        if rank == 0:
            log.info("epoch %d val RMSE (norm.) %s", epoch,
                     " ".join(f"{v}={r:.4f}" for v, r in zip(VARS, rmse.tolist())))
            if score < best:
                best = score
                save_checkpoint(os.path.join(out_dir, "best.pt"), model, opt, sched, epoch, step, best)
            save_checkpoint(latest, model, opt, sched, epoch, step, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
