"""ClimaX-style fine-tuning for global forecasting at 5.625deg (32x64), single node.

Uses torch.multiprocessing.spawn (one process per visible GPU), so it can be started with plain
`python 08_climax_spawn_finetune.py ...` from a job script.
"""
import argparse
import functools
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IN_VARS = ["2m_temperature", "10m_u_component_of_wind", "10m_v_component_of_wind",
           "geopotential_500", "temperature_850", "specific_humidity_850", "u_component_of_wind_850",
           "v_component_of_wind_850", "land_sea_mask", "orography"]
OUT_VARS = ["geopotential_500", "temperature_850", "2m_temperature"]


class NpzForecast(Dataset):
    """Shards written by ClimaX's nc2np script: each npz holds (T, 1, 32, 64) arrays per variable."""

    def __init__(self, root, split, max_lead_h=72, hrs_per_step=6):
        files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.x = np.concatenate([np.stack([np.load(f)[v][:, 0] for v in IN_VARS], 1) for f in files])
        mean = np.load(os.path.join(root, "normalize_mean.npz"))
        std = np.load(os.path.join(root, "normalize_std.npz"))
        self.mean = np.array([mean[v] for v in IN_VARS]).reshape(1, -1, 1, 1)
        self.std = np.array([std[v] for v in IN_VARS]).reshape(1, -1, 1, 1)
        self.x = ((self.x - self.mean) / self.std).astype(np.float32)
        self.out_idx = [IN_VARS.index(v) for v in OUT_VARS]
        self.max_steps = max_lead_h // hrs_per_step
        self.hrs = hrs_per_step
        self.fixed_lead = split != "train"

    def __len__(self):
        return self.x.shape[0] - self.max_steps

    def __getitem__(self, i):
        k = self.max_steps if self.fixed_lead else random.randint(1, self.max_steps)
        x = torch.from_numpy(self.x[i])
        y = torch.from_numpy(self.x[i + k, self.out_idx])
        return x, y, torch.tensor(k * self.hrs / 100.0, dtype=torch.float32)


class ClimaX(nn.Module):
    def __init__(self, n_in, n_out, img=(32, 64), patch=2, dim=1024, depth=8, heads=16):
        super().__init__()
        self.patch, self.img, self.n_out = patch, img, n_out
        self.n_patch = (img[0] // patch) * (img[1] // patch)
        # one patch embedding per input variable (variable tokenisation)
        self.tok = nn.ModuleList([nn.Conv2d(1, dim, patch, patch) for _ in range(n_in)])
        self.var_embed = nn.Parameter(torch.randn(1, n_in, dim) * 0.02)
        self.var_query = nn.Parameter(torch.zeros(1, 1, dim))
        self.var_agg = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.pos_embed = nn.Parameter(torch.randn(1, self.n_patch, dim) * 0.02)
        self.lead_embed = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=4.0, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, n_out * patch * patch))

    def forward(self, x, lead):
        B, V, H, W = x.shape
        toks = torch.stack([self.tok[v](x[:, v:v + 1]).flatten(2).transpose(1, 2) for v in range(V)], 1)
        toks = toks + self.var_embed.unsqueeze(2)                     # B, V, L, D
        toks = toks.permute(0, 2, 1, 3).reshape(B * self.n_patch, V, -1)
        q = self.var_query.expand(toks.shape[0], -1, -1)
        z = self.var_agg(q, toks, toks, need_weights=False)[0].reshape(B, self.n_patch, -1)
        z = z + self.pos_embed + self.lead_embed(lead.view(-1, 1)).unsqueeze(1)
        for blk in self.blocks:
            z = blk(z)
        z = self.head(self.norm(z))
        h, w, p = H // self.patch, W // self.patch, self.patch
        z = z.view(B, h, w, p, p, self.n_out).permute(0, 5, 1, 3, 2, 4)
        return z.reshape(B, self.n_out, H, W)


def lat_weights(h=32, device="cpu"):
    lat = np.linspace(-87.1875, 87.1875, h)
    w = np.cos(np.deg2rad(lat))
    return torch.tensor(w / w.mean(), dtype=torch.float32, device=device).view(1, 1, h, 1)


def seed_worker(worker_id, base):
    random.seed(base + worker_id)
    np.random.seed((base + worker_id) % 2**32)


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)  # per-rank lead-time sampling in the data pipeline

    train_ds = NpzForecast(args.root, "train")
    val_ds = NpzForecast(args.root, "val")
    val_part = Subset(val_ds, range(rank, len(val_ds), world_size))
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True,
                          worker_init_fn=functools.partial(seed_worker, base=args.seed * 1000 + rank * 16))
    val_dl = DataLoader(val_part, 64, num_workers=2, pin_memory=True)

    net = ClimaX(len(IN_VARS), len(OUT_VARS)).to(device)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")
        sd = {k.replace("net.", "", 1): v for k, v in sd["state_dict"].items() if not k.startswith("net.head")}
        missing, unexpected = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded pretrained; missing={len(missing)} unexpected={len(unexpected)}")
    model = DDP(net, device_ids=[rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * len(train_dl), pct_start=0.05)
    w = lat_weights(device=device)

    ck_path = os.path.join(args.out, "last.ckpt")
    start = 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location={"cuda:0": f"cuda:{rank}"})
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y, lead) in enumerate(train_dl):
            x, y, lead = x.to(device, non_blocking=True), y.to(device, non_blocking=True), lead.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, lead)
            loss = ((pred.float() - y) ** 2 * w).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        net.eval()
        sse = torch.zeros(len(OUT_VARS), device=device, dtype=torch.float64)
        n = torch.zeros(1, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y, lead in val_dl:
                x, y, lead = x.to(device), y.to(device), lead.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = net(x, lead).float()
                sse += ((pred - y) ** 2 * w).mean(dim=(-1, -2)).sum(0).double()
                n += x.shape[0]
        dist.all_reduce(sse)
        dist.all_reduce(n)
        out_std = torch.tensor(val_ds.std[0, val_ds.out_idx, 0, 0], device=device)
        rmse = torch.sqrt(sse / n) * out_std

        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val wRMSE@{val_ds.max_steps * 6}h: "
                  + ", ".join(f"{v}={r:.3f}" for v, r in zip(OUT_VARS, rmse.tolist())), flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ck_path)
        dist.barrier()

    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/5.625deg_npz")
    p.add_argument("--pretrained", default=None)
    p.add_argument("--out", default="ckpt/climax_ft")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--port", default="29517")
    args = p.parse_args()

    world_size = torch.cuda.device_count()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
