"""ViT forecaster on 1.40625deg ERA5 (ClimaX-like), sharded with FSDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        07_fsdp_climax_era5.py --zarr /lustre/era5/1.40625deg.zarr --out /lustre/$USER/climax
"""
import argparse
import functools
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import xarray as xr
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig,
                                    FullyShardedDataParallel as FSDP, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VARS = ["geopotential_500", "temperature_850", "2m_temperature",
        "10m_u_component_of_wind", "10m_v_component_of_wind", "specific_humidity_700"]


class ERA5Zarr(Dataset):
    def __init__(self, path, start, end, lead_steps):
        ds = xr.open_zarr(path).sel(time=slice(start, end))
        self.arr = ds[VARS].to_array("var").transpose("time", "var", "latitude", "longitude")
        self.lead = lead_steps

    def __len__(self):
        return self.arr.sizes["time"] - self.lead

    def __getitem__(self, i):
        x = self.arr.isel(time=i).values.astype(np.float32)
        y = self.arr.isel(time=i + self.lead).values.astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(y)


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0, drop=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=drop, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViTForecaster(nn.Module):
    def __init__(self, channels, img_size, patch=4, dim=1024, depth=16, heads=16):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.grid = (img_size[0] // patch, img_size[1] // patch)
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, channels * patch * patch)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        b = x.size(0)
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            h = blk(h)
        h = self.head(self.norm(h))  # [B, N, C*p*p]
        gh, gw = self.grid
        h = h.view(b, gh, gw, self.channels, self.patch, self.patch)
        h = h.permute(0, 3, 1, 4, 2, 5).reshape(b, self.channels, gh * self.patch, gw * self.patch)
        return x + h


def channel_stats(loader, device, max_batches):
    """Per-channel mean / std over the training years; each rank sees its own shard."""
    acc = torch.zeros(3, len(VARS), device=device, dtype=torch.float64)
    for i, (x, _) in enumerate(loader):
        if i == max_batches:
            break
        x = x.to(device, dtype=torch.float64)
        acc[0] += x.sum(dim=(0, 2, 3))
        acc[1] += (x ** 2).sum(dim=(0, 2, 3))
        acc[2] += x[:, 0].numel()
    dist.all_reduce(acc)
    mean = acc[0] / acc[2]
    std = (acc[1] / acc[2] - mean ** 2).sqrt()
    return mean.float(), std.float()


def save_checkpoint(model, optimizer, epoch, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_state, "optim": optim_state, "epoch": epoch}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_checkpoint(model, optimizer, path):
    ckpt = torch.load(path, map_location="cpu")
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, ckpt["optim"]))
    return ckpt["epoch"] + 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lead-steps", type=int, default=6)  # 6h data -> 36h lead
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--stats-batches", type=int, default=200)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_ds = ERA5Zarr(args.zarr, "1979", "2015", args.lead_steps)
    val_ds = ERA5Zarr(args.zarr, "2016", "2016", args.lead_steps)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=4, pin_memory=True, drop_last=True)

    mean, std = channel_stats(loader, device, args.stats_batches)
    mean, std = mean[None, :, None, None], std[None, :, None, None]

    img = (128, 256)
    model = ViTForecaster(len(VARS), img)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=wrap,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16),
                 device_id=torch.cuda.current_device(), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "latest.pt")
    start_epoch = load_checkpoint(model, optimizer, ckpt_path) if os.path.exists(ckpt_path) else 0
    if rank == 0:
        print(f"starting at epoch {start_epoch}, {len(loader)} steps/epoch", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in loader:
            x = (x.to(device, non_blocking=True) - mean) / std
            y = (y.to(device, non_blocking=True) - mean) / std
            loss = nn.functional.mse_loss(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x = (x.to(device, non_blocking=True) - mean) / std
                y = (y.to(device, non_blocking=True) - mean) / std
                val += torch.stack([nn.functional.mse_loss(model(x).float(), y),
                                    torch.ones((), device=device)])
        dist.all_reduce(run)
        dist.all_reduce(val)
        if rank == 0:
            print(f"epoch {epoch} train_mse {(run[0] / run[1]).item():.4f} "
                  f"val_mse {(val[0] / val[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)
        save_checkpoint(model, optimizer, epoch, ckpt_path, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
