#!/usr/bin/env python
"""
Global ocean emulator (5-day step) on 1/4 deg reanalysis, ~1.3B-param transformer,
FSDP full sharding + bf16 on 8 nodes x 4 GPUs.

    srun --nodes=8 --ntasks-per-node=1 torchrun --nnodes=8 --nproc_per_node=4 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=$SLURM_JOB_ID \
        20_fsdp_ocean_emulator.py --cfg cfg/ocean_1p3b.yaml
"""
import argparse
import functools
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl, apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

FIELDS = ["ssh", "sst", "sss", "u0", "v0", "t100", "s100", "t300", "s300"]
FORCING = ["taux", "tauy", "qnet", "emp"]


class OceanSteps(Dataset):
    def __init__(self, root, years, stats):
        # state: (T, C, H, W), forcing: (T, F, H, W), year: (T,) -- plain .npy so they can be memory-mapped
        self.state = np.load(os.path.join(root, "state.npy"), mmap_mode="r")
        self.forcing = np.load(os.path.join(root, "forcing.npy"), mmap_mode="r")
        self.time = np.load(os.path.join(root, "year.npy"))
        self.idx = [t for t in range(len(self.time) - 1) if self.time[t] in years]
        self.mu = np.asarray(stats["mean"], np.float32)[:, None, None]
        self.sd = np.asarray(stats["std"], np.float32)[:, None, None]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        t = self.idx[k]
        x = (np.asarray(self.state[t], np.float32) - self.mu) / self.sd
        y = (np.asarray(self.state[t + 1], np.float32) - self.mu) / self.sd
        f = np.asarray(self.forcing[t], np.float32)
        return torch.from_numpy(np.nan_to_num(np.concatenate([x, f]))), torch.from_numpy(np.nan_to_num(y))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.n1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class OceanTransformer(nn.Module):
    def __init__(self, cin, cout, grid, patch=8, dim=2048, depth=24, heads=16):
        super().__init__()
        self.grid, self.patch, self.cout = grid, patch, cout
        n = (grid[0] // patch) * (grid[1] // patch)
        self.embed = nn.Conv2d(cin, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, n, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, cout * patch * patch)

    def forward(self, x):
        B = x.shape[0]
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            h = blk(h)
        h = self.out(self.norm(h))
        gh, gw, p = self.grid[0] // self.patch, self.grid[1] // self.patch, self.patch
        h = h.view(B, gh, gw, self.cout, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, self.cout, *self.grid)
        return x[:, : self.cout] + h


def compute_stats(root, years, stride=30):
    state = np.load(os.path.join(root, "state.npy"), mmap_mode="r")
    year = np.load(os.path.join(root, "year.npy"))
    sel = [t for t in range(0, len(year), stride) if year[t] in years]
    mean, std = [], []
    for c in range(state.shape[1]):
        v = np.asarray(state[sel, c], np.float64)
        mean.append(float(np.nanmean(v))); std.append(float(np.nanstd(v)))
    return {"mean": mean, "std": std}


def save_full_checkpoint(model, opt, epoch, path):
    cfg_m = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    cfg_o = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    # every rank takes part in gathering the shards; only rank 0 receives the full dicts
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg_m, cfg_o):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd, "epoch": epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load_full_checkpoint(model, opt, path):
    ckpt = torch.load(path, map_location="cpu")
    cfg_m = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    cfg_o = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg_m, cfg_o):
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
    return ckpt["epoch"] + 1


def masked_mse(pred, y, ocean):
    return ((pred - y) ** 2 * ocean).sum() / (ocean.sum() * pred.shape[0] * pred.shape[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: the other ranks wait in broadcast_object_list while rank 0 computes the stats
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # normalisation statistics: computed once on rank 0, shared with everyone
    holder = [compute_stats(cfg["data"], cfg["train_years"]) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    stats = holder[0]

    train_ds = OceanSteps(cfg["data"], cfg["train_years"], stats)
    val_ds = OceanSteps(cfg["data"], cfg["val_years"], stats)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    # padded val sampler: every rank runs the same number of FSDP forwards
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["batch_size"], sampler=val_sampler, num_workers=4)
    ocean = torch.from_numpy(np.load(cfg["mask"]).astype(np.float32)).to(device)[None, None]

    torch.manual_seed(0)
    model = OceanTransformer(len(FIELDS) + len(FORCING), len(FIELDS), tuple(cfg["grid"]),
                             dim=cfg["dim"], depth=cfg["depth"], heads=cfg["heads"])
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 device_id=torch.cuda.current_device(), use_orig_params=True, limit_all_gathers=True)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)

    ckpt_path = os.path.join(cfg["out_dir"], "full_state.pt")
    start = load_full_checkpoint(model, opt, ckpt_path) if os.path.exists(ckpt_path) else 0
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"world {world}, per-GPU batch {cfg['batch_size']}, start epoch {start}", flush=True)

    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = masked_mse(model(x).float(), y, ocean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        model.eval()
        vs = torch.zeros(len(FIELDS) + 1, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                err = (model(x).float() - y) ** 2 * ocean
                vs[:-1] += err.sum(dim=(0, 2, 3)) / ocean.sum()
                vs[-1] += x.shape[0]
        dist.all_reduce(vs)
        rmse = torch.sqrt(vs[:-1] / vs[-1]).tolist()
        if rank == 0:
            print(f"epoch {epoch} train {(run[0] / run[1]).item():.4e} val RMSE(norm) "
                  + " ".join(f"{f}={r:.3f}" for f, r in zip(FIELDS, rmse)) + f" {time.time() - t0:.0f}s", flush=True)
        save_full_checkpoint(model, opt, epoch, ckpt_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
