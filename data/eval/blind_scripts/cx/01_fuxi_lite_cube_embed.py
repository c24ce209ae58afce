"""FuXi-lite: cube embedding of two consecutive states (t-6h, t) -> U-Transformer
-> next state. 1.0 deg ERA5 (181 x 360, cropped to 180 x 360), 5 upper-air
variables x 13 levels + 5 surface variables = 70 channels.

torchrun --standalone --nproc_per_node=8 01_fuxi_lite_cube_embed.py --config fuxi_lite.yaml
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset


class TwoStepDataset(Dataset):
    """Returns (x_{t-1}, x_t) stacked on a time axis and the target x_{t+1}."""

    def __init__(self, nc_dir, years, stats_file, n_out=1):
        files = [os.path.join(nc_dir, f"era5_70ch_{y}.nc") for y in years]
        self.ds = xr.open_mfdataset(files, combine="nested", concat_dim="time")["data"]
        st = np.load(stats_file)
        self.mu = st["mean"].astype(np.float32)[:, None, None]
        self.sd = st["std"].astype(np.float32)[:, None, None]
        self.n_out = n_out

    def __len__(self):
        return self.ds.sizes["time"] - 1 - self.n_out

    def __getitem__(self, i):
        w = self.ds.isel(time=slice(i, i + 2 + self.n_out), lat=slice(0, 180)).values.astype(np.float32)
        w = (w - self.mu) / self.sd
        return torch.from_numpy(w[:2]), torch.from_numpy(w[2:])


class SwinLikeBlock(nn.Module):
    """Windowed MHSA (8 x 8 windows) + MLP; windows do not shift in the lite version."""

    def __init__(self, dim, heads, win=8):
        super().__init__()
        self.win = win
        self.n1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.n2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # B, H, W, C
        B, H, W, C = x.shape
        s = self.win
        pad_h, pad_w = (-H) % s, (-W) % s
        h = F.pad(self.n1(x), (0, 0, 0, pad_w, 0, pad_h))
        Hp, Wp = H + pad_h, W + pad_w
        h = h.view(B, Hp // s, s, Wp // s, s, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, C)
        h = self.attn(h, h, h, need_weights=False)[0]
        h = h.view(B, Hp // s, Wp // s, s, s, C).permute(0, 1, 3, 2, 4, 5).reshape(B, Hp, Wp, C)[:, :H, :W]
        x = x + h
        return x + self.mlp(self.n2(x))


class FuXiLite(nn.Module):
    def __init__(self, ch=70, dim=512, depth=12, heads=8):
        super().__init__()
        self.cube = nn.Conv3d(ch, dim, kernel_size=(2, 4, 4), stride=(2, 4, 4))     # -> 45 x 90
        self.cube_norm = nn.LayerNorm(dim)
        self.down = nn.Conv2d(dim, dim, 3, stride=2, padding=1)                     # -> 23 x 45
        self.down_norm = nn.GroupNorm(32, dim)
        self.blocks = nn.ModuleList([SwinLikeBlock(dim, heads) for _ in range(depth)])
        self.up = nn.ConvTranspose2d(dim, dim, 2, stride=2)
        self.up_norm = nn.GroupNorm(32, dim)
        self.fc = nn.Linear(2 * dim, ch * 16)
        self.ch = ch

    def forward(self, x2):  # x2: B, 2, C, H, W
        B, _, C, H, W = x2.shape
        e = self.cube(x2.transpose(1, 2)).squeeze(2)                         # B, D, 45, 90
        e = self.cube_norm(e.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        h = F.silu(self.down_norm(self.down(e)))
        h = h.permute(0, 2, 3, 1)
        for blk in self.blocks:
            h = blk(h)
        h = F.silu(self.up_norm(self.up(h.permute(0, 3, 1, 2))))[:, :, : e.shape[2], : e.shape[3]]
        h = self.fc(torch.cat([h, e], dim=1).permute(0, 2, 3, 1))            # B, 45, 90, C*16
        h = h.view(B, H // 4, W // 4, 4, 4, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, H, W)
        return x2[:, 1] + h


def lat_weights(device):
    lat = torch.arange(90.0, -90.0, -1.0, device=device)  # 180 rows, south pole cropped
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="fuxi_lite.yaml")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.get("seed", 2023))

    train_set = TwoStepDataset(cfg["nc_dir"], range(cfg["train_first"], cfg["train_last"] + 1), cfg["stats"])
    val_set = TwoStepDataset(cfg["nc_dir"], cfg["val_years"], cfg["stats"], n_out=cfg.get("val_rollout", 20))
    val_set = Subset(val_set, list(range(rank, len(val_set), 2 * world)))  # 00/12 UTC inits
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                              num_workers=cfg.get("workers", 8), pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, shuffle=False, num_workers=4, pin_memory=True)

    model = FuXiLite(dim=cfg.get("dim", 512), depth=cfg.get("depth", 12)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    iters = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters)
    w = lat_weights(device)
    n_val = cfg.get("val_rollout", 20)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    for epoch in range(cfg["epochs"]):
        model.train()
        tic = time.time()
        for it, (x2, y) in enumerate(train_loader):
            x2, y = x2.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x2)
            loss = (w * (pred.float() - y[:, 0]).abs()).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[ep {epoch} it {it}/{len(train_loader)}] l1 {loss.item():.4f}", flush=True)

        # autoregressive 5-day rollout; the two-state input window slides forward
        model.eval()
        sse = torch.zeros(n_val, 70, device=device, dtype=torch.float64)
        cnt = torch.zeros((), device=device, dtype=torch.float64)
        with torch.no_grad():
            for x2, y in val_loader:
                x2, y = x2.to(device), y.to(device)
                for k in range(n_val):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        nxt = model.module(x2).float()
                    sse[k] += (w * (nxt - y[:, k]) ** 2).mean(dim=(-2, -1)).sum(0).double()
                    x2 = torch.stack([x2[:, 1], nxt], dim=1)
                cnt += x2.shape[0]
        dist.all_reduce(sse)
        dist.all_reduce(cnt)
        rmse = torch.sqrt(sse / cnt)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - tic:.0f}s): mean normalised RMSE d1 {rmse[3].mean():.4f} "
                  f"d3 {rmse[11].mean():.4f} d5 {rmse[19].mean():.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "cfg": cfg},
                       os.path.join(cfg["out_dir"], f"fuxi_lite_ep{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
