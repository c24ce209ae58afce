"""FengWu-lite: one encoder per variable group (surface, z, q, u, v, t), a cross-modal
transformer fuser and one decoder per group; trained on 6 h steps with a 2-step
rollout, validated with 10-day rollouts from every 00/12 UTC init of 2018.

Validation writes per-init ACC / RMSE curves (needed for the significance
tests in the paper) to <out>/valid_scores_epXX.npz.
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

GROUPS = {
    "surface": ["u10", "v10", "t2m", "msl"],
    "z": [f"z{l}" for l in (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)],
    "q": [f"q{l}" for l in (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)],
    "u": [f"u{l}" for l in (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)],
    "v": [f"v{l}" for l in (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)],
    "t": [f"t{l}" for l in (50, 100, 150, 200, 250, 300, 400, 500, 600, 700, 850, 925, 1000)],
}
ALL_VARS = [v for g in GROUPS.values() for v in g]


class Windows(Dataset):
    def __init__(self, zarr, start, end, steps, stats):
        ds = xr.open_zarr(zarr).sel(time=slice(start, end))
        self.arr = ds[ALL_VARS].to_array("v").transpose("time", "v", "lat", "lon")
        self.mu = stats["mean"][:, None, None].astype(np.float32)
        self.sd = stats["std"][:, None, None].astype(np.float32)
        self.steps = steps

    def __len__(self):
        return self.arr.sizes["time"] - self.steps

    def __getitem__(self, i):
        w = self.arr.isel(time=slice(i, i + self.steps + 1)).values.astype(np.float32)
        return torch.from_numpy((w - self.mu) / self.sd)


class GroupEncoder(nn.Module):
    def __init__(self, cin, dim, patch=4):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, dim // 2, 3, padding=1), nn.GELU(),
                                 nn.Conv2d(dim // 2, dim, patch, patch))

    def forward(self, x):
        return self.net(x)


class GroupDecoder(nn.Module):
    def __init__(self, dim, cout, patch=4):
        super().__init__()
        self.net = nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, patch, patch), nn.GELU(),
                                 nn.Conv2d(dim // 2, cout, 3, padding=1))

    def forward(self, h):
        return self.net(h)


class FengWuLite(nn.Module):
    def __init__(self, dim=256, depth=8, heads=8, grid=(120, 240), patch=4):
        super().__init__()
        self.sizes = [len(v) for v in GROUPS.values()]
        self.encoders = nn.ModuleList([GroupEncoder(n, dim, patch) for n in self.sizes])
        self.decoders = nn.ModuleList([GroupDecoder(dim, n, patch) for n in self.sizes])
        self.group_embed = nn.Parameter(torch.zeros(len(self.sizes), 1, dim))
        n_tok = (grid[0] // patch) * (grid[1] // patch)
        self.pos = nn.Parameter(torch.zeros(1, n_tok, dim))
        layer = nn.TransformerEncoderLayer(dim * len(self.sizes), heads, 2 * dim * len(self.sizes),
                                           dropout=0.0, batch_first=True, norm_first=True)
        self.fuser = nn.TransformerEncoder(layer, depth)
        self.dim = dim
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        B, _, H, W = x.shape
        parts = torch.split(x[:, :, :120], self.sizes, dim=1)
        toks = [enc(p).flatten(2).transpose(1, 2) + self.pos + self.group_embed[i]
                for i, (enc, p) in enumerate(zip(self.encoders, parts))]
        h = self.fuser(torch.cat(toks, dim=-1))
        hs = h.split(self.dim, dim=-1)
        gh, gw = 120 // 4, W // 4
        outs = [dec(t.transpose(1, 2).reshape(B, self.dim, gh, gw)) for dec, t in zip(self.decoders, hs)]
        delta = torch.cat(outs, dim=1)
        return torch.cat([x[:, :, :120] + delta, x[:, :, 120:]], dim=2)


def lat_weights(lat, device):
    w = np.cos(np.deg2rad(lat))
    return torch.as_tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, -1, 1)


@torch.no_grad()
def rollout_scores(model, loader, w, clim, steps, device):
    """Per-init ACC and RMSE for every lead time: (n_init, steps, n_var)."""
    model.eval()
    accs, rmses = [], []
    for win in loader:
        win = win.to(device, non_blocking=True)
        x = win[:, 0]
        acc_i, rmse_i = [], []
        for s in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = model(x).float()
            p, t = x[:, :, :120], win[:, s + 1, :, :120]
            pa, ta = p - clim, t - clim
            acc = (w * pa * ta).sum((-2, -1)) / torch.sqrt((w * pa ** 2).sum((-2, -1)) * (w * ta ** 2).sum((-2, -1)))
            acc_i.append(acc)
            rmse_i.append((w * (p - t) ** 2).mean((-2, -1)).sqrt())
        accs.append(torch.stack(acc_i, 1))
        rmses.append(torch.stack(rmse_i, 1))
    return torch.cat(accs), torch.cat(rmses)


def gather_cat(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zarr", default="/fsx/era5/1p5deg_6h_69var.zarr")
    ap.add_argument("--stats", default="/fsx/era5/1p5deg_stats_1979_2015.npz")
    ap.add_argument("--clim", default="/fsx/era5/1p5deg_clim_norm_1990_2017.npy")
    ap.add_argument("--out", default="/fsx/runs/fengwu_lite")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    ap.add_argument("--train_steps", type=int, default=2)
    ap.add_argument("--eval_steps", type=int, default=40)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    stats = np.load(args.stats)
    train_ds = Windows(args.zarr, "1979-01-01", "2015-12-31", args.train_steps, stats)
    val_full = Windows(args.zarr, "2018-01-01", "2018-12-31", args.eval_steps, stats)
    inits = list(range(0, len(val_full), 2))
    # contiguous block of inits per rank keeps each rank's zarr reads within neighbouring chunks
    per_rank = math.ceil(len(inits) / world)
    my_inits = inits[rank * per_rank: (rank + 1) * per_rank]
    val_ds = Subset(val_full, my_inits)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=2, shuffle=False, num_workers=4, pin_memory=True)

    lat = xr.open_zarr(args.zarr).lat.values[:120]
    w = lat_weights(lat, dev)
    clim = torch.as_tensor(np.load(args.clim)[:, :120], dtype=torch.float32, device=dev)

    model = DDP(FengWuLite().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl), eta_min=1e-7)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, win in enumerate(train_dl):
            win = win.to(dev, non_blocking=True)
            x, loss = win[:, 0], 0.0
            for s in range(args.train_steps):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    x = model(x)
                loss = loss + (w * (x.float()[:, :, :120] - win[:, s + 1, :, :120]).abs()).mean()
            loss = loss / args.train_steps
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.4f}", flush=True)

        acc, rmse = rollout_scores(model.module, val_dl, w, clim, args.eval_steps, dev)
        acc_all, rmse_all = gather_cat(acc), gather_cat(rmse)
        if rank == 0:
            zi, ti = ALL_VARS.index("z500"), ALL_VARS.index("t850")
            m_acc = acc_all.mean(0)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) z500 ACC d5 {m_acc[19, zi]:.3f} d10 {m_acc[39, zi]:.3f} "
                  f"| t850 ACC d5 {m_acc[19, ti]:.3f}", flush=True)
            np.savez(os.path.join(args.out, f"valid_scores_ep{epoch:02d}.npz"),
                     acc=acc_all.cpu().numpy(), rmse=rmse_all.cpu().numpy(), inits=np.array(inits))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
