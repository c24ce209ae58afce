"""Multi-step fine-tuning of a 0.25 deg ViT forecaster (pretrained on 1-step).

The model is unrolled for K = 2..8 steps with a curriculum (K grows every
`--curriculum_every` epochs); activations of the transformer blocks are
recomputed in backward so that an 8-step rollout fits in 80 GB.

    torchrun --standalone --nproc_per_node=8 05_vit_multistep_ckpt.py --init /weka/wx/vit/1step/best.pt
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("multistep")
VARIABLES = ["u10", "v10", "t2m", "msl", "sp", "tcwv", "z500", "t500", "u500", "v500", "q500",
             "z850", "t850", "u850", "v850", "q850", "z250", "u250", "v250", "t250"]


class RolloutWindows(Dataset):
    def __init__(self, zarr, years, max_steps, stats):
        ds = xr.open_zarr(zarr)
        ds = ds.sel(time=ds.time.dt.year.isin(list(years)))
        self.a = ds[VARIABLES].to_array("v").transpose("time", "v", "lat", "lon").isel(lat=slice(0, 720))
        self.mu = np.array([stats[v][0] for v in VARIABLES], np.float32)[:, None, None]
        self.sd = np.array([stats[v][1] for v in VARIABLES], np.float32)[:, None, None]
        self.max_steps = max_steps

    def __len__(self):
        return self.a.sizes["time"] - self.max_steps

    def __getitem__(self, i):
        w = self.a.isel(time=slice(i, i + self.max_steps + 1)).values.astype(np.float32)
        return torch.from_numpy((w - self.mu) / self.sd)


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViTForecaster(nn.Module):
    def __init__(self, ch, img=(720, 1440), patch=8, dim=1024, depth=16, heads=16, grad_ckpt=True):
        super().__init__()
        self.p, self.ch, self.grad_ckpt = patch, ch, grad_ckpt
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * patch * patch)

    def forward(self, x):
        B = x.shape[0]
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                h = checkpoint(blk, h, use_reentrant=True)
            else:
                h = blk(h)
        h = self.head(self.norm(h)).view(B, self.gh, self.gw, self.p, self.p, self.ch)
        return x + h.permute(0, 5, 1, 3, 2, 4).reshape(B, self.ch, self.gh * self.p, self.gw * self.p)


def lat_weights(device):
    lat = torch.linspace(90, -89.75, 720, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def rollout_loss(model, win, k, w):
    x, loss = win[:, 0], 0.0
    for s in range(1, k + 1):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = model(x)
        loss = loss + (w * (x.float() - win[:, s]) ** 2).mean()
    return loss / k


@torch.no_grad()
def evaluate(net, loader, w, steps, device):
    net.eval()
    s = torch.zeros(steps + 1, device=device, dtype=torch.float64)
    for win in loader:
        win = win.to(device)
        x = win[:, 0]
        for k in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = net(x).float()
            s[k] += (w * (x - win[:, k + 1]) ** 2).mean(dim=(1, 2, 3)).sum().double()
        s[-1] += win.shape[0]
    dist.all_reduce(s)
    return torch.sqrt(s[:-1] / s[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/weka/wx/era5_0p25_6h.zarr")
    ap.add_argument("--stats", default="/weka/wx/era5_0p25_stats_1979_2016.npz")
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", default="/weka/wx/vit/multistep")
    ap.add_argument("--max_rollout", type=int, default=8)
    ap.add_argument("--curriculum_every", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--eval_steps", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    stats = np.load(args.stats)
    train_ds = RolloutWindows(args.zarr, range(1979, 2017), args.max_rollout, stats)
    val_ds = RolloutWindows(args.zarr, [2018], args.eval_steps, stats)
    val_ds = Subset(val_ds, list(range(0, len(val_ds), 8))[rank::world])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=8, pin_memory=True,
                          persistent_workers=True, prefetch_factor=2)
    val_dl = DataLoader(val_ds, batch_size=1, num_workers=4)

    net = ViTForecaster(len(VARIABLES)).to(device)
    sd = torch.load(args.init, map_location="cpu")
    net.load_state_dict(sd["model"])
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    w = lat_weights(device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        k = min(2 + epoch // args.curriculum_every, args.max_rollout)
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, win in enumerate(train_dl):
            win = win.to(device, non_blocking=True)
            loss = rollout_loss(model, win, k, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            if it % 50 == 0:
                logger.info("epoch %d K=%d it %d/%d loss %.5f", epoch, k, it, len(train_dl), loss.item())

        rmse = evaluate(net, val_dl, w, args.eval_steps, device)
        if rank == 0:
            logger.info("epoch %d done in %.0fs | mean norm. RMSE d1 %.4f d3 %.4f d5 %.4f", epoch,
                        time.time() - t0, rmse[3], rmse[11], rmse[19])
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "rollout": k},
                       os.path.join(args.out, f"ep{epoch:02d}_K{k}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
