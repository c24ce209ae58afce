"""ClimaX-style pretraining on CMIP6 (MPI-ESM, 5.625deg) with variable tokenisation.

Each step trains on a random subset of the input variables so that the model learns to forecast
from whatever variables a downstream dataset provides.

    torchrun --nproc_per_node=8 15_climax_pretrain_vardrop.py --root data/cmip6_mpi_5.625
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.models.vision_transformer import Block, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

ALL_VARS = ["t2m", "u10", "v10", "z50", "z250", "z500", "z600", "z700", "z850", "z925",
            "t50", "t250", "t500", "t850", "t925", "u250", "u500", "u850", "v250", "v500", "v850",
            "q250", "q500", "q850", "lsm", "orography"]
OUT_VARS = ["z500", "t850", "t2m", "u10", "v10"]


class CMIP6Shards(Dataset):
    def __init__(self, root, split, lead_steps=(1, 2, 4, 8, 12, 20, 28), hrs=6):
        files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.data = np.concatenate([np.load(f)["fields"] for f in files], 0).astype(np.float32)  # T, V, 32, 64
        st = np.load(os.path.join(root, "stats.npz"))
        self.data = (self.data - st["mean"][None, :, None, None]) / st["std"][None, :, None, None]
        self.leads = lead_steps
        self.hrs = hrs
        self.out_idx = [ALL_VARS.index(v) for v in OUT_VARS]
        self.fixed = split != "train"

    def __len__(self):
        return self.data.shape[0] - max(self.leads)

    def __getitem__(self, i):
        k = self.leads[-1] if self.fixed else self.leads[np.random.randint(len(self.leads))]
        return (torch.from_numpy(self.data[i]), torch.from_numpy(self.data[i + k, self.out_idx]),
                torch.tensor(k * self.hrs / 100.0))


class ClimaX(nn.Module):
    def __init__(self, var_names, out_vars, img=(32, 64), patch=2, dim=1024, depth=8, heads=16):
        super().__init__()
        self.var_names, self.out_vars = var_names, out_vars
        self.img, self.patch = img, patch
        self.token_embeds = nn.ModuleList([PatchEmbed(img, patch, 1, dim) for _ in var_names])
        self.var_embed = nn.Parameter(torch.zeros(1, len(var_names), dim))
        self.var_query = nn.Parameter(torch.zeros(1, 1, dim))
        self.var_agg = nn.MultiheadAttention(dim, heads, batch_first=True)
        n_patch = self.token_embeds[0].num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patch, dim))
        self.lead_time_embed = nn.Linear(1, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True, drop_path=0.1 * i / depth)
                                     for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, len(out_vars) * patch ** 2))
        nn.init.trunc_normal_(self.var_embed, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x, var_idx, lead):
        B = x.shape[0]
        toks = torch.stack([self.token_embeds[v](x[:, j:j + 1]) for j, v in enumerate(var_idx)], 1)
        toks = toks + self.var_embed[:, var_idx].unsqueeze(2)          # B, V, L, D
        V, L, D = toks.shape[1:]
        toks = toks.transpose(1, 2).reshape(B * L, V, D)
        z = self.var_agg(self.var_query.expand(B * L, -1, -1), toks, toks, need_weights=False)[0]
        z = z.view(B, L, D) + self.pos_embed + self.lead_time_embed(lead.view(B, 1)).unsqueeze(1)
        for blk in self.blocks:
            z = blk(z)
        z = self.head(self.norm(z))
        h, w, p, c = self.img[0] // self.patch, self.img[1] // self.patch, self.patch, len(self.out_vars)
        return z.view(B, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(B, c, h * p, w * p)


def lat_weighted_mse(pred, y, w):
    return ((pred - y) ** 2 * w).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--min-vars", type=int, default=12)
    ap.add_argument("--out", default="ckpt/climax_pretrain")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = CMIP6Shards(args.root, "train")
    val_ds = CMIP6Shards(args.root, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 64, num_workers=2)

    net = ClimaX(ALL_VARS, OUT_VARS).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=1e-5)
    total, warm = args.epochs * len(loader), args.warmup_epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    lat = np.linspace(-87.1875, 87.1875, 32)
    w = torch.tensor(np.cos(np.deg2rad(lat)), dtype=torch.float32, device=device)
    w = (w / w.mean()).view(1, 1, 32, 1)
    all_idx = list(range(len(ALL_VARS)))

    os.makedirs(args.out, exist_ok=True)
    ck_path = os.path.join(args.out, "last.ckpt")
    start = 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y, lead) in enumerate(loader):
            x, y, lead = x.to(device, non_blocking=True), y.to(device, non_blocking=True), lead.to(device)
            k = random.randint(args.min_vars, len(ALL_VARS))
            var_idx = sorted(random.sample(all_idx, k))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x[:, var_idx], var_idx, lead)
            loss = lat_weighted_mse(pred.float(), y, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} n_vars {k} loss {loss.item():.4f}", flush=True)

        net.eval()
        acc = torch.zeros(len(OUT_VARS) + 1, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y, lead in val_loader:
                x, y, lead = x.to(device), y.to(device), lead.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = net(x, all_idx, lead).float()
                acc[:-1] += ((pred - y) ** 2 * w).mean(dim=(-1, -2)).sum(0).double()
                acc[-1] += x.shape[0]
        dist.all_reduce(acc)
        rmse = torch.sqrt(acc[:-1] / acc[-1])
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val wRMSE (norm.) "
                  + " ".join(f"{v}={r:.3f}" for v, r in zip(OUT_VARS, rmse.tolist())), flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
