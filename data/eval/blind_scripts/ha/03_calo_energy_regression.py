#!/usr/bin/env python3
# Energy calibration network for CaloChallenge dataset 2 (electron showers in a
# 45 x 16 x 9 (layer, alpha, r) voxelised Si-W calorimeter).
# Predicts log(E_inc) from the voxel energies; used as the reference regressor
# for the fast-sim validation plots.
#
# usage (one node, 4 GPUs):
#   torchrun --standalone --nproc_per_node=4 03_calo_energy_regression.py \
#       --train /data/calochallenge/ds2/dataset_2_1.hdf5 \
#       --test  /data/calochallenge/ds2/dataset_2_2.hdf5 --outdir ckpt/ds2_reg
import argparse
import logging
import math
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

N_LAYERS, N_ALPHA, N_R = 45, 16, 9

log = logging.getLogger("calo_reg")


class CaloShowers(Dataset):
    def __init__(self, path, e_scale=1000.0):
        self.path = path
        self.e_scale = e_scale
        self.f = None
        with h5py.File(path, "r") as f:
            self.n = f["incident_energies"].shape[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        shower = self.f["showers"][i].astype(np.float32)
        e_inc = float(self.f["incident_energies"][i, 0])
        x = np.log1p(shower / self.e_scale).reshape(1, N_LAYERS, N_ALPHA, N_R)
        y = np.float32(math.log(e_inc / self.e_scale))
        return torch.from_numpy(x), torch.tensor(y)


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, stride=stride, padding=1)
        self.norm = nn.GroupNorm(8, cout)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.norm(self.conv(x)))


class CaloRegressor(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.blocks = nn.Sequential(
            ConvBlock(1, width, 1),
            ConvBlock(width, width, (2, 1, 1)),
            ConvBlock(width, 2 * width, 2),
            ConvBlock(2 * width, 4 * width, 2),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool3d(1), nn.Flatten(),
            nn.Linear(4 * width + 1, 128), nn.GELU(), nn.Linear(128, 2),
        )

    def forward(self, x):
        e_sum = torch.log1p(torch.expm1(x).sum(dim=(1, 2, 3, 4))).unsqueeze(1)
        h = self.blocks(x)
        h = self.head[1](self.head[0](h))
        out = self.head[2:](torch.cat([h, e_sum], dim=1))
        mu, log_sigma = out[:, 0], out[:, 1].clamp(-6, 3)
        return mu, log_sigma


def gaussian_nll(mu, log_sigma, y):
    return (0.5 * ((y - mu) / log_sigma.exp()) ** 2 + log_sigma).mean()


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--outdir", default="ckpt/ds2_reg")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--val-frac", type=float, default=0.1)
    ap.add_argument("--resume", default="")
    ap.add_argument("--num-workers", type=int, default=6)
    return ap.parse_args()


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device)  # nll_sum, sq_err_sum (relative), abs_pull_sum, n
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        mu, ls = model(x)
        acc[0] += gaussian_nll(mu, ls, y) * y.numel()
        rel = torch.exp(mu - y) - 1.0
        acc[1] += (rel ** 2).sum()
        acc[2] += ((mu - y).abs() / ls.exp()).sum()
        acc[3] += y.numel()
    dist.all_reduce(acc, op=dist.ReduceOp.SUM)
    n = acc[3]
    return {"nll": (acc[0] / n).item(), "rel_rms": torch.sqrt(acc[1] / n).item(),
            "mean_abs_pull": (acc[2] / n).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(message)s")

    full = CaloShowers(args.train)
    n_val = int(args.val_frac * len(full))
    # fixed split: last n_val showers are validation (files are already shuffled)
    train_ds = Subset(full, range(0, len(full) - n_val))
    val_idx = range(len(full) - n_val, len(full))
    val_ds = Subset(full, val_idx[rank::world_size])
    test_full = CaloShowers(args.test)
    test_ds = Subset(test_full, range(rank, len(test_full), world_size))

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=512, num_workers=args.num_workers, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=512, num_workers=args.num_workers, pin_memory=True)

    model = CaloRegressor(width=args.width).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=3)

    start_epoch, best = 0, float("inf")
    ckpt_path = os.path.join(args.outdir, "checkpoint.pt")
    resume_from = args.resume or (ckpt_path if os.path.exists(ckpt_path) else "")
    if resume_from:
        ckpt = torch.load(resume_from)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        log.info("resumed from %s at epoch %d", resume_from, start_epoch)

    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tl = torch.zeros(2, device=device)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            mu, ls = model(x)
            loss = gaussian_nll(mu, ls, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])
            if it % 200 == 0:
                log.info("epoch %d it %d loss %.4f", epoch, it, loss.item())
        dist.all_reduce(tl)

        val = run_eval(model.module, val_loader, device)
        scheduler.step(val["nll"])
        log.info("epoch %d train_nll %.4f val_nll %.4f val_rel_rms %.4f pull %.3f",
                 epoch, (tl[0] / tl[1]).item(), val["nll"], val["rel_rms"], val["mean_abs_pull"])

        if rank == 0:
            is_best = val["nll"] < best
            best = min(best, val["nll"])
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best,
                     "args": vars(args)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if is_best:
                torch.save(state["model"], os.path.join(args.outdir, "best_model.pt"))
        else:
            best = min(best, val["nll"])
        dist.barrier()

    # final numbers on the independent test file, with the best weights
    best_sd = torch.load(os.path.join(args.outdir, "best_model.pt"), map_location=device)
    model.module.load_state_dict(best_sd)
    test = run_eval(model.module, test_loader, device)
    log.info("TEST nll %.4f rel_rms %.4f mean_abs_pull %.3f",
             test["nll"], test["rel_rms"], test["mean_abs_pull"])

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
