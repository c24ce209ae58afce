"""1.3B-parameter ViT weather model on 0.25 deg ERA5, sharded with FSDP.

  torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29400 \
      15_fsdp_vit_giant.py --out /lustre/wx/vit_giant
"""
import argparse
import functools
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VARS = ["u10", "v10", "t2m", "sp", "msl", "tcwv", "z50", "z250", "z500", "z850", "z1000",
        "t250", "t500", "t850", "u250", "u500", "u850", "v250", "v500", "v850", "q500", "q850"]


class ERA5Step(Dataset):
    def __init__(self, zarr, years, stats):
        ds = xr.open_zarr(zarr)
        ds = ds.sel(time=ds.time.dt.year.isin(list(years)))
        self.a = ds[VARS].to_array("v").transpose("time", "v", "lat", "lon").isel(lat=slice(0, 720))
        self.mu = np.asarray([stats[v][0] for v in VARS], np.float32)[:, None, None]
        self.sd = np.asarray([stats[v][1] for v in VARS], np.float32)[:, None, None]

    def __len__(self):
        return self.a.sizes["time"] - 1

    def __getitem__(self, i):
        xy = (self.a.isel(time=[i, i + 1]).values.astype(np.float32) - self.mu) / self.sd
        return torch.from_numpy(xy[0]), torch.from_numpy(xy[1]), i


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.n2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class ViTGiant(nn.Module):
    def __init__(self, ch, img=(720, 1440), patch=8, dim=2048, depth=24, heads=16):
        super().__init__()
        self.p, self.ch = patch, ch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(ch, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * patch * patch)

    def forward(self, x):
        B = x.shape[0]
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for b in self.blocks:
            h = b(h)
        h = self.head(self.norm(h)).view(B, self.gh, self.gw, self.p, self.p, self.ch)
        return x + h.permute(0, 5, 1, 3, 2, 4).reshape(B, self.ch, self.gh * self.p, self.gw * self.p)


def lat_weights(device):
    lat = torch.linspace(90, -89.75, 720, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


@torch.no_grad()
def validate(model, loader, n_total, w, device):
    """Per-sample lat-weighted MSE, gathered so that DistributedSampler's padding is not double counted."""
    model.eval()
    errs, idxs = [], []
    for x, y, idx in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x).float()
        errs.append((w * (pred - y) ** 2).mean(dim=(-2, -1)))
        idxs.append(idx.to(device))
    errs, idxs = torch.cat(errs), torch.cat(idxs)
    all_e = [torch.empty_like(errs) for _ in range(dist.get_world_size())]
    all_i = [torch.empty_like(idxs) for _ in range(dist.get_world_size())]
    dist.all_gather(all_e, errs)
    dist.all_gather(all_i, idxs)
    per_sample = torch.zeros(n_total, errs.shape[1], device=device)
    per_sample[torch.cat(all_i)] = torch.cat(all_e)
    return per_sample.mean(0).sqrt()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/lustre/wx/era5_0p25_6h.zarr")
    ap.add_argument("--stats", default="/lustre/wx/era5_0p25_stats.npz")
    ap.add_argument("--out", default="/lustre/wx/vit_giant")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    stats = np.load(args.stats)
    train_ds = ERA5Step(args.zarr, range(1979, 2017), stats)
    val_ds = ERA5Step(args.zarr, [2018], stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = ViTGiant(len(VARS))
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.05, 1 - s / total))
    w = lat_weights(device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = (w * (pred.float() - y) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.5f} ({(time.time() - t0) / 50:.2f}s/it)", flush=True)
                t0 = time.time()

        rmse = validate(model, val_dl, len(val_ds), w, device)
        if rank == 0:
            print(f"epoch {epoch}: val rmse z500 {rmse[VARS.index('z500')]:.4f} "
                  f"t850 {rmse[VARS.index('t850')]:.4f} mean {rmse.mean():.4f}", flush=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                cpu_state = model.state_dict()
            torch.save({"model": cpu_state, "epoch": epoch, "step": step},
                       os.path.join(args.out, f"vit_giant_ep{epoch:02d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
