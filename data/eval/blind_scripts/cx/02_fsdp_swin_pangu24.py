"""Large Swin-style 24 h model (Pangu-24h analogue) on 0.25 deg ERA5, sharded with FSDP.

Weights are initialised from the 6 h model (read on rank 0 only and broadcast by
FSDP), full state dicts are consolidated on rank 0 for saving, and validation
scores 7-day rollouts (7 x 24 h) over every 00 UTC init of 2018.

  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
      02_fsdp_swin_pangu24.py --init /shared/wx/pangu6h/final.pt --out /shared/wx/pangu24h
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
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VARS = ["z500", "z850", "z250", "t500", "t850", "t250", "u500", "u850", "u250", "v500", "v850", "v250",
        "q500", "q850", "msl", "t2m", "u10", "v10"]


class DailySteps(Dataset):
    def __init__(self, zarr, years, stats, n_days):
        ds = xr.open_zarr(zarr)
        ds = ds.sel(time=ds.time.dt.year.isin(list(years)))
        self.a = ds[VARS].to_array("v").transpose("time", "v", "lat", "lon").isel(lat=slice(0, 720))
        self.mu = np.asarray([stats[v][0] for v in VARS], np.float32)[:, None, None]
        self.sd = np.asarray([stats[v][1] for v in VARS], np.float32)[:, None, None]
        self.n_days = n_days

    def __len__(self):
        return self.a.sizes["time"] - 4 * self.n_days

    def __getitem__(self, i):
        w = self.a.isel(time=slice(i, i + 4 * self.n_days + 1, 4)).values.astype(np.float32)
        return torch.from_numpy((w - self.mu) / self.sd), i


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, win, shift):
        super().__init__()
        self.win, self.shift, self.heads = win, shift, heads
        self.n1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, H, W, C = x.shape
        s = self.win
        h = self.n1(x)
        if self.shift:
            h = torch.roll(h, shifts=-(s // 2), dims=2)  # shift along longitude only (periodic)
        h = h.view(B, H // s, s, W // s, s, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, C)
        q, k, v = self.qkv(h).view(-1, s * s, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, s * s, C)
        h = self.proj(h).view(B, H // s, W // s, s, s, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        if self.shift:
            h = torch.roll(h, shifts=s // 2, dims=2)
        x = x + h
        return x + self.mlp(self.n2(x))


class SwinForecaster(nn.Module):
    def __init__(self, ch, patch=4, dim=1536, depth=24, heads=24, win=10):
        super().__init__()
        self.p, self.ch = patch, ch
        self.embed = nn.Conv2d(ch, dim, patch, patch)             # 720x1440 -> 180x360
        self.blocks = nn.ModuleList([SwinBlock(dim, heads, win, shift=i % 2 == 1) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, ch * patch * patch)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.embed(x).permute(0, 2, 3, 1)
        for blk in self.blocks:
            h = blk(h)
        h = self.head(self.norm(h)).view(B, H // self.p, W // self.p, self.p, self.p, C)
        return x + h.permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)


def lat_weights(device):
    lat = torch.linspace(90, -89.75, 720, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


@torch.no_grad()
def validate(model, loader, n_total, n_days, w, device):
    model.eval()
    errs, idxs = [], []
    for win, idx in loader:
        win = win.to(device)
        x, e = win[:, 0], []
        for d in range(n_days):
            x = model(x).float()
            e.append((w * (x - win[:, d + 1]) ** 2).mean(dim=(-2, -1)))   # B, C
        errs.append(torch.stack(e, 1))
        idxs.append(idx.to(device))
    errs, idxs = torch.cat(errs), torch.cat(idxs)
    # DistributedSampler pads by repeating indices; scatter by sample index to count each init once
    ge = [torch.empty_like(errs) for _ in range(dist.get_world_size())]
    gi = [torch.empty_like(idxs) for _ in range(dist.get_world_size())]
    dist.all_gather(ge, errs)
    dist.all_gather(gi, idxs)
    all_i = torch.cat(gi)
    per_init = torch.zeros(n_total, n_days, errs.shape[-1], device=device)
    seen = torch.zeros(n_total, dtype=torch.bool, device=device)
    per_init[all_i] = torch.cat(ge)
    seen[all_i] = True
    return per_init[seen].mean(0).sqrt()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/shared/wx/era5_0p25_6h.zarr")
    ap.add_argument("--stats", default="/shared/wx/era5_0p25_stats.npz")
    ap.add_argument("--init", default=None)
    ap.add_argument("--out", default="/shared/wx/pangu24h")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    stats = np.load(args.stats)
    train_ds = DailySteps(args.zarr, range(1979, 2017), stats, n_days=1)
    val_ds = DailySteps(args.zarr, [2018], stats, n_days=7)
    val_ds = torch.utils.data.Subset(val_ds, list(range(0, len(val_ds), 4)))   # 00 UTC inits
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=1, sampler=train_sampler, num_workers=8, pin_memory=True,
                          persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=4, pin_memory=True)

    model = SwinForecaster(len(VARS))
    last = os.path.join(args.out, "last.pt")
    resume = args.resume and os.path.exists(last)
    ckpt = None
    if rank == 0 and (resume or args.init):
        ckpt = torch.load(last if resume else args.init, map_location="cpu")
        model.load_state_dict(ckpt["model"])

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={SwinBlock}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        device_id=local_rank,
        sync_module_states=True,   # rank 0 holds the loaded weights; broadcast them to the others
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=3e-6)
    start_epoch = 0
    if resume:
        # optimizer state: full dict on rank 0, scattered into shards on every rank
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=True),
                                  FullOptimStateDictConfig(rank0_only=True)):
            osd = FSDP.optim_state_dict_to_load(model, opt, ckpt["opt"] if rank == 0 else None)
        opt.load_state_dict(osd)
        start = torch.tensor([ckpt["epoch"] + 1 if rank == 0 else 0], device=device)
        dist.broadcast(start, src=0)
        start_epoch = int(start.item())
    w = lat_weights(device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (win, _) in enumerate(train_dl):
            win = win.to(device, non_blocking=True)
            pred = model(win[:, 0])
            loss = (w * (pred.float() - win[:, 1]).abs()).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_dl)} l1 {loss.item():.4f}", flush=True)

        rmse = validate(model, val_dl, len(val_ds.dataset), 7, w, device)
        cfg = (FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
               FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *cfg):
            msd = model.state_dict()
            osd = FSDP.optim_state_dict(model, opt)
        if rank == 0:
            zi = VARS.index("z500")
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) z500 RMSE(norm) d1 {rmse[0, zi]:.4f} "
                  f"d3 {rmse[2, zi]:.4f} d5 {rmse[4, zi]:.4f} d7 {rmse[6, zi]:.4f}", flush=True)
            torch.save({"model": msd, "opt": osd, "epoch": epoch}, last + ".tmp")
            os.replace(last + ".tmp", last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
