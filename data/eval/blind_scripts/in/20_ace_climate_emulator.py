"""ACE-like climate emulator: 6 h steps with prescribed SST/forcings, trained on a 4-step rollout,
validated on a 30-day free run (time-mean bias and lat-weighted RMSE).

Two nodes on Slurm (shared /gpfs):
    srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 20_ace_climate_emulator.py --cfg ace.yaml
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
import xarray as xr
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

LOG = logging.getLogger("ace")


class ForcedSeq(Dataset):
    """Prognostic state plus forcings (SST, TOA insolation) for an n-step window."""

    def __init__(self, path, start, end, n_steps, prog_vars, forcing_vars, stats):
        ds = xr.open_zarr(path).sel(time=slice(start, end))
        self.prog = ds[prog_vars].to_array("c").transpose("time", "c", "lat", "lon")
        self.forc = ds[forcing_vars].to_array("c").transpose("time", "c", "lat", "lon")
        self.n_steps = n_steps
        self.pm = stats["prog_mean"][:, None, None]
        self.ps = stats["prog_std"][:, None, None]
        self.fm = stats["forc_mean"][:, None, None]
        self.fs = stats["forc_std"][:, None, None]

    def __len__(self):
        return self.prog.sizes["time"] - self.n_steps

    def __getitem__(self, i):
        sl = slice(i, i + self.n_steps + 1)
        p = (self.prog.isel(time=sl).values.astype(np.float32) - self.pm) / self.ps
        f = (self.forc.isel(time=sl).values.astype(np.float32) - self.fm) / self.fs
        return torch.from_numpy(p), torch.from_numpy(f)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.n2(x))


class Emulator(nn.Module):
    def __init__(self, n_prog, n_forc, nlat=180, nlon=360, patch=6, dim=512, depth=10):
        super().__init__()
        self.p, self.n_prog = patch, n_prog
        self.gh, self.gw = nlat // patch, nlon // patch
        self.embed = nn.Conv2d(n_prog + n_forc, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_prog * patch * patch)

    def forward(self, state, forcing):
        B, C, H, W = state.shape
        h = self.embed(torch.cat([state, forcing], 1)).flatten(2).transpose(1, 2) + self.pos
        h = self.head(self.norm(self.blocks(h)))
        h = h.view(B, self.gh, self.gw, C, self.p, self.p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
        return state + h


def lat_w(lat, device):
    w = torch.cos(torch.deg2rad(torch.as_tensor(lat, dtype=torch.float32, device=device)))
    return (w / w.mean()).view(1, 1, -1, 1)


def save_checkpoint(path, net, opt, sched, epoch, best):
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "epoch": epoch, "best_rmse": best}, path)


@torch.no_grad()
def free_run(net, loader, w, std, device):
    """Roll the emulator over each validation window; RMSE of the window mean and of every step."""
    net.eval()
    acc = torch.zeros(2, std.shape[1], dtype=torch.float64, device=device)
    n = torch.zeros((), dtype=torch.float64, device=device)
    for prog, forc in loader:
        prog, forc = prog.to(device), forc.to(device)
        x, preds = prog[:, 0], []
        for k in range(prog.shape[1] - 1):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = net(x, forc[:, k]).float()
            preds.append(x)
        preds = torch.stack(preds, 1)
        tgt = prog[:, 1:]
        bias = ((preds.mean(1) - tgt.mean(1)) * std) ** 2
        step = ((preds - tgt) * std.unsqueeze(1)) ** 2
        acc[0] += (bias * w).mean(dim=(-2, -1)).sqrt().sum(0).double()
        acc[1] += (step * w.unsqueeze(1)).mean(dim=(-2, -1)).sqrt().mean(1).sum(0).double()
        n += prog.shape[0]
    dist.all_reduce(acc)
    dist.all_reduce(n)
    net.train()
    return (acc / n).cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    with open(ap.parse_args().cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(process)d] %(message)s")

    stats = {k: v.astype(np.float32) for k, v in np.load(cfg["stats"]).items()}
    pv, fv = cfg["prognostic"], cfg["forcings"]
    train_ds = ForcedSeq(cfg["zarr"], "1940-01-01", "2010-12-31", cfg["rollout"], pv, fv, stats)
    val_full = ForcedSeq(cfg["zarr"], "2012-01-01", "2020-12-31", cfg["free_run_steps"], pv, fv, stats)
    # independent 30-day windows, every 60 days
    inits = list(range(0, len(val_full), 240))
    val_ds = Subset(val_full, inits[rank::world])
    lat = xr.open_zarr(cfg["zarr"])["lat"].values

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=cfg["seed"])
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_per_gpu"], sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, num_workers=2, pin_memory=True)

    net = Emulator(len(pv), len(fv)).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / cfg["ref_batch"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = cfg["epochs"] * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    ckpt_dir = cfg["ckpt_dir"]
    os.makedirs(ckpt_dir, exist_ok=True)
    last = os.path.join(ckpt_dir, "ckpt.tar")
    start_epoch, best = 0, float("inf")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"] + 1, ck["best_rmse"]
        LOG.info("resumed from epoch %d", ck["epoch"])

    w = lat_w(lat, device)
    std_t = torch.from_numpy(stats["prog_std"]).to(device).view(1, -1, 1, 1)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (prog, forc) in enumerate(train_dl):
            prog = prog.to(device, non_blocking=True)
            forc = forc.to(device, non_blocking=True)
            x, loss = prog[:, 0], 0.0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                for k in range(cfg["rollout"]):
                    x = model(x, forc[:, k])
                    loss = loss + ((x.float() - prog[:, k + 1]) ** 2 * w).mean()
            loss = loss / cfg["rollout"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 200 == 0:
                LOG.info("epoch %d it %d/%d loss %.4f", epoch, it, len(train_dl), loss.item())

        scores = free_run(net, val_dl, w, std_t, device)
        mean_bias, step_rmse = scores[0], scores[1]
        score = step_rmse.mean().item()
        LOG.info("epoch %d (%.0fs) 30d free run: time-mean bias RMSE %s | step RMSE %s", epoch,
                 time.time() - t0, np.round(mean_bias.numpy(), 3).tolist(), np.round(step_rmse.numpy(), 3).tolist())
        save_checkpoint(last, net, opt, sched, epoch, min(best, score))
        if score < best:
            best = score
            save_checkpoint(os.path.join(ckpt_dir, "best_ckpt.tar"), net, opt, sched, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
