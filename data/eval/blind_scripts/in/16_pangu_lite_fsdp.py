"""Pangu-lite: 3D (pressure level x lat x lon) patch embedding + transformer, trained with FSDP.
Upper-air: 5 vars x 13 levels; surface: 4 vars. 1.0 deg grid (180 x 360, north pole row dropped).

    torchrun --nproc_per_node=8 16_pangu_lite_fsdp.py --data /gpfs/era5_1deg --out /gpfs/runs/pangu_lite
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
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_UP, N_LEV, N_SFC = 5, 13, 4


class PanguData(Dataset):
    def __init__(self, root, years, stats, lead=1):
        self.up = [np.load(f"{root}/upper_{y}.npy", mmap_mode="r") for y in years]      # (T, 5, 13, 181, 360)
        self.sfc = [np.load(f"{root}/surface_{y}.npy", mmap_mode="r") for y in years]   # (T, 4, 181, 360)
        self.items = [(k, t) for k, a in enumerate(self.up) for t in range(a.shape[0] - lead)]
        self.lead = lead
        self.um, self.us = stats["up_mean"][:, :, None, None], stats["up_std"][:, :, None, None]
        self.sm, self.ss = stats["sfc_mean"][:, None, None], stats["sfc_std"][:, None, None]

    def __len__(self):
        return len(self.items)

    def _get(self, k, t):
        up = (np.asarray(self.up[k][t, :, :, 1:], dtype=np.float32) - self.um) / self.us
        sfc = (np.asarray(self.sfc[k][t, :, 1:], dtype=np.float32) - self.sm) / self.ss
        return torch.from_numpy(up), torch.from_numpy(sfc)

    def __getitem__(self, i):
        k, t = self.items[i]
        return (*self._get(k, t), *self._get(k, t + self.lead))


class EarthBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))
        return x + self.ffn(self.ln2(x))


class PanguLite(nn.Module):
    def __init__(self, dim=512, depth=16, heads=16, patch=(2, 4, 4)):
        super().__init__()
        self.pz, self.ph, self.pw = patch
        self.nz = math.ceil(N_LEV / self.pz)
        self.nh, self.nw = 180 // self.ph, 360 // self.pw
        self.up_embed = nn.Conv3d(N_UP, dim, patch, patch)
        self.sfc_embed = nn.Conv2d(N_SFC, dim, patch[1:], patch[1:])
        self.pos = nn.Parameter(torch.zeros(1, (self.nz + 1) * self.nh * self.nw, dim))
        self.blocks = nn.ModuleList([EarthBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.up_head = nn.Linear(dim, N_UP * self.pz * self.ph * self.pw)
        self.sfc_head = nn.Linear(dim, N_SFC * self.ph * self.pw)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, up, sfc):
        B = up.shape[0]
        up_p = F.pad(up, (0, 0, 0, 0, 0, self.nz * self.pz - N_LEV))
        tu = self.up_embed(up_p).flatten(2).transpose(1, 2)
        ts = self.sfc_embed(sfc).flatten(2).transpose(1, 2)
        h = torch.cat([tu, ts], dim=1) + self.pos
        for blk in self.blocks:
            h = blk(h)
        h = self.norm(h)
        n_up = self.nz * self.nh * self.nw
        du = self.up_head(h[:, :n_up]).view(B, self.nz, self.nh, self.nw, N_UP, self.pz, self.ph, self.pw)
        du = du.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(B, N_UP, self.nz * self.pz, 180, 360)[:, :, :N_LEV]
        ds = self.sfc_head(h[:, n_up:]).view(B, self.nh, self.nw, N_SFC, self.ph, self.pw)
        ds = ds.permute(0, 3, 1, 4, 2, 5).reshape(B, N_SFC, 180, 360)
        return up + du, sfc + ds


def lat_weights(device):
    lat = torch.arange(89.0, -91.0, -1.0, device=device)      # rows 1..180 of the 181-row grid
    w = torch.cos(torch.deg2rad(lat))
    return w / w.mean()


def pangu_loss(pu, ps, tu, ts, w):
    # Pangu weights surface 0.25 relative to upper air
    lu = ((pu - tu).abs() * w.view(1, 1, 1, -1, 1)).mean()
    ls = ((ps - ts).abs() * w.view(1, 1, -1, 1)).mean()
    return lu + 0.25 * ls


def save_full_checkpoint(model, optim, epoch, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim), "epoch": epoch}
    torch.save(state, path)


@torch.no_grad()
def evaluate(model, loader, n_total, w, stats_t, rank, world, device):
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)   # z500, t2m, count
    seen = 0
    for up, sfc, tu, ts in loader:
        up, sfc, tu, ts = (t.to(device) for t in (up, sfc, tu, ts))
        pu, ps = model(up, sfc)
        pos = rank + world * (seen + torch.arange(up.shape[0], device=device))
        valid = (pos < n_total).double()
        z = ((pu[:, 0, 7].float() - tu[:, 0, 7]) * stats_t["z_std"]) ** 2        # z at 500 hPa
        t2 = ((ps[:, 2].float() - ts[:, 2]) * stats_t["t2m_std"]) ** 2
        acc[0] += ((z * w.view(1, -1, 1)).mean(dim=(-2, -1)).sqrt().double() * valid).sum()
        acc[1] += ((t2 * w.view(1, -1, 1)).mean(dim=(-2, -1)).sqrt().double() * valid).sum()
        acc[2] += valid.sum()
        seen += up.shape[0]
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=1, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=50)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    stats = {k: v.astype(np.float32) for k, v in np.load(f"{args.data}/stats.npz").items()}
    train_ds = PanguData(args.data, range(1979, 2016), stats)
    val_ds = PanguData(args.data, [2017], stats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch, sampler=train_sampler, num_workers=8, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = FSDP(PanguLite(), device_id=local_rank, use_orig_params=True,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={EarthBlock}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    # 192 GPUs x batch 1 in the paper; scale down linearly
    lr = args.lr * world * args.batch / 192
    optim = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=3e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.epochs)

    w = lat_weights(device)
    stats_t = {"z_std": float(stats["up_std"][0, 7]), "t2m_std": float(stats["sfc_std"][2])}
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, lr {lr:.2e}, {len(train_dl)} steps/epoch", flush=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (up, sfc, tu, ts) in enumerate(train_dl):
            up, sfc, tu, ts = (t.to(device, non_blocking=True) for t in (up, sfc, tu, ts))
            pu, ps = model(up, sfc)
            loss = pangu_loss(pu.float(), ps.float(), tu, ts, w)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)
        sched.step()

        z500, t2m = evaluate(model, val_dl, len(val_ds), w, stats_t, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val z500 {z500:.1f} t2m {t2m:.3f}", flush=True)
            save_full_checkpoint(model, optim, epoch, os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
