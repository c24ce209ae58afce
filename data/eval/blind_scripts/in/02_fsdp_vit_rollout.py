"""ViT-style global forecaster on 1.40625 deg ERA5, trained with FSDP and a multi-step rollout loss.

    torchrun --standalone --nproc_per_node=8 02_fsdp_vit_rollout.py --config configs/vit_l.yaml
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
import zarr
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    ShardingStrategy, StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ERA5Zarr(Dataset):
    def __init__(self, path, start, end, rollout, stats):
        self.path = path
        times = zarr.open(path, mode="r")["time"][:].astype("datetime64[h]")
        sel = np.where((times >= np.datetime64(start)) & (times < np.datetime64(end)))[0]
        self.t0, self.t1 = int(sel[0]), int(sel[-1]) + 1
        self.rollout = rollout
        self.mean = stats["mean"][:, None, None].astype(np.float32)
        self.std = stats["std"][:, None, None].astype(np.float32)
        self._arr = None

    def __len__(self):
        return self.t1 - self.t0 - self.rollout

    def __getitem__(self, i):
        if self._arr is None:  # opened lazily so each worker has its own handle
            self._arr = zarr.open(self.path, mode="r")["data"]
        t = self.t0 + i
        x = (self._arr[t:t + self.rollout + 1].astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(x[0]), torch.from_numpy(x[1:])


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio=4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(dim * mlp_ratio), dim))
        self.heads = heads

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, D // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, D))
        return x + self.mlp(self.norm2(x))


class ViTForecaster(nn.Module):
    def __init__(self, n_vars, img=(128, 256), patch=2, dim=1024, depth=24, heads=16):
        super().__init__()
        self.patch, self.img = patch, img
        self.grid = (img[0] // patch, img[1] // patch)
        self.embed = nn.Conv2d(n_vars, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_vars * patch * patch)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            h = blk(h)
        h = self.head(self.norm(h))
        gh, gw = self.grid
        h = h.view(B, gh, gw, C, self.patch, self.patch).permute(0, 3, 1, 4, 2, 5)
        return x + h.reshape(B, C, H, W)


def lat_weights(n_lat, device):
    lat = 90.0 - (torch.arange(n_lat, device=device) + 0.5) * 180.0 / n_lat
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def save_checkpoint(model, optim, epoch, step, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_state, "optim": optim_state, "epoch": epoch, "step": step}, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_checkpoint(model, optim, path):
    ckpt = torch.load(path, map_location="cpu")
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, ckpt["optim"]))
    return ckpt["epoch"], ckpt["step"]


@torch.no_grad()
def validate(model, loader, sampler, n_total, std, w, rank, world, device, n_vars):
    model.eval()
    sq_sum = torch.zeros(n_vars, device=device, dtype=torch.float64)
    count = torch.zeros(1, device=device, dtype=torch.float64)
    seen = 0
    for x0, ys in loader:
        x0, y = x0.to(device), ys[:, 0].to(device)
        pred = model(x0).float()
        rmse = ((((pred - y) * std) ** 2) * w).mean(dim=(-2, -1)).sqrt()
        # DistributedSampler pads the last round with repeats; drop them from the metric
        pos = rank + world * (seen + torch.arange(x0.shape[0], device=device))
        keep = (pos < n_total).double()
        sq_sum += (rmse.double() * keep[:, None]).sum(0)
        count += keep.sum()
        seen += x0.shape[0]
    dist.all_reduce(sq_sum)
    dist.all_reduce(count)
    model.train()
    return sq_sum / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", action="store_true")
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 0))

    stats = dict(np.load(cfg["stats"]))
    n_vars = len(stats["mean"])
    train_ds = ERA5Zarr(cfg["zarr"], "1979-01-01", "2016-01-01", cfg["rollout"], stats)
    val_ds = ERA5Zarr(cfg["zarr"], "2017-01-01", "2018-01-01", 1, stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=cfg.get("seed", 0))
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    bs = cfg["batch_size_per_gpu"]
    train_dl = DataLoader(train_ds, bs, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(val_ds, bs, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = ViTForecaster(n_vars, dim=cfg["dim"], depth=cfg["depth"], heads=cfg["heads"])
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=wrap, device_id=local_rank, use_orig_params=True,
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))

    # lr in the config is for the reference global batch; scale linearly
    global_bs = bs * world
    lr = cfg["lr"] * global_bs / cfg["ref_global_batch"]
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    total = cfg["epochs"] * len(train_dl)
    warm = cfg["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    ckpt_path = os.path.join(cfg["out_dir"], "checkpoint.pt")
    start_epoch, step = 0, 0
    if ap.parse_args().resume and os.path.exists(ckpt_path):
        start_epoch, step = load_checkpoint(model, optim, ckpt_path)
        start_epoch += 1
        for _ in range(step):
            sched.step()
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"world={world} global_batch={global_bs} lr={lr:.2e} steps/epoch={len(train_dl)}")

    w = lat_weights(128, device)
    std = torch.tensor(stats["std"], device=device).view(1, -1, 1, 1)
    for epoch in range(start_epoch, cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for x0, ys in train_dl:
            x, ys = x0.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            loss = 0.0
            for k in range(ys.shape[1]):
                x = model(x)
                loss = loss + (((x.float() - ys[:, k]) ** 2) * w).mean()
            loss = loss / ys.shape[1]
            optim.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 50:.2f}s/it", flush=True)
                    t0 = time.time()

        rmse = validate(model, val_dl, val_sampler, len(val_ds), std, w, rank, world, device, n_vars)
        if rank == 0:
            names = cfg["variables"]
            print(f"epoch {epoch} val RMSE " + ", ".join(f"{n}={r:.3f}" for n, r in zip(names, rmse.tolist())))
        save_checkpoint(model, optim, epoch, step, ckpt_path, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
