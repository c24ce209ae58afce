"""Two-step autoregressive fine-tuning of a pre-trained ViT weather emulator.

Stage 2 of the FourCastNet recipe: start from the 6h single-step checkpoint and
fine-tune on the loss of a two-step rollout (x_t -> x_{t+6h} -> x_{t+12h}) with a
small learning rate.  Channel 20 is SST, which is undefined over land; those
points are masked out of the loss.

sbatch excerpt:
    srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        05_vit_emulator_finetune_2step.py --pretrained /project/wx/vit_6h/best.pt \
        --out /project/wx/vit_6h_ft2
"""
import argparse
import os
import time
from datetime import datetime

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SST = 20


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/project/wx/era5_h5")
    p.add_argument("--years", default="1979-2015")
    p.add_argument("--val-year", type=int, default=2016)
    p.add_argument("--pretrained", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bs", type=int, default=2, help="per-GPU batch")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--amp", action="store_true", default=True)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


class ERA5TwoStep(Dataset):
    def __init__(self, root, years, mean, std):
        self.paths = [os.path.join(root, f"{y}.h5") for y in years]
        with h5py.File(self.paths[0], "r") as f:
            self.steps_per_year = f["fields"].shape[0]
        self.mean, self.std = mean, std
        self.h5 = None

    def __len__(self):
        return len(self.paths) * (self.steps_per_year - 2)

    def __getitem__(self, idx):
        if self.h5 is None:
            self.h5 = [h5py.File(p, "r")["fields"] for p in self.paths]
        y, t = divmod(idx, self.steps_per_year - 2)
        block = self.h5[y][t:t + 3, :, :720].astype(np.float32)  # (3, C, H, W)
        block = (block - self.mean) / self.std
        return torch.from_numpy(block)


class PatchViT(nn.Module):
    def __init__(self, channels=21, img=(720, 1440), patch=16, dim=1024, depth=16, heads=16):
        super().__init__()
        self.c, self.p = channels, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.proj = nn.Conv2d(channels, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, self.gh * self.gw, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, channels * patch * patch)

    def forward(self, x):
        b = x.shape[0]
        tok = self.proj(x).flatten(2).transpose(1, 2) + self.pos
        tok = self.norm(self.encoder(tok))
        out = self.head(tok).view(b, self.gh, self.gw, self.c, self.p, self.p)
        out = out.permute(0, 3, 1, 4, 2, 5).reshape(b, self.c, self.gh * self.p, self.gw * self.p)
        return x + out


def weighted_mse(pred, target, w_lat, valid):
    se = (pred - target) ** 2 * w_lat * valid
    return se.sum() / (valid.expand_as(se) * w_lat).sum()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    stats = np.load(os.path.join(args.data, "stats", "normalization.npz"))
    mean, std = stats["mean"].astype(np.float32), stats["std"].astype(np.float32)  # (1, C, 1, 1)
    y0, y1 = map(int, args.years.split("-"))
    train_ds = ERA5TwoStep(args.data, range(y0, y1 + 1), mean, std)
    val_ds = ERA5TwoStep(args.data, [args.val_year], mean, std)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, prefetch_factor=4)
    val_idx = list(range(0, len(val_ds), 20))[rank::world]
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=1, num_workers=2)

    model = PatchViT().to(dev)
    sd = torch.load(args.pretrained, map_location="cpu")
    model.load_state_dict(sd["model"])
    model = DDP(model, device_ids=[local_rank])

    lat = torch.linspace(90, -90, 721)[:720]
    w_lat = torch.cos(torch.deg2rad(lat))
    w_lat = (w_lat / w_lat.mean()).view(1, 1, -1, 1).to(dev)
    land = torch.from_numpy(np.load(os.path.join(args.data, "stats", "land_mask.npy"))[:720]).to(dev)
    valid = torch.ones(1, 21, 720, 1440, device=dev)
    valid[:, SST] = 1.0 - land

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=0.0)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    os.makedirs(args.out, exist_ok=True)
    ck_path = os.path.join(args.out, "ft_last.pt")
    start = 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, n_skipped = time.time(), 0
        for it, block in enumerate(loader):
            block = torch.nan_to_num(block.to(dev, non_blocking=True), nan=0.0)
            x0, x1, x2 = block[:, 0], block[:, 1], block[:, 2]
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                p1 = model(x0)
                p2 = model(p1)
                loss = weighted_mse(p1.float(), x1, w_lat, valid) + weighted_mse(p2.float(), x2, w_lat, valid)
            if not torch.isfinite(loss):
                n_skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if it % args.log_every == 0:
                logged = loss.detach().clone()
                dist.all_reduce(logged)
                if rank == 0:
                    print(f"{datetime.now():%H:%M:%S} ep {epoch} it {it}/{len(loader)} "
                          f"loss {logged.item() / world:.4f} scale {scaler.get_scale():.0f}", flush=True)

        model.eval()
        acc = torch.zeros(3, device=dev)
        with torch.no_grad():
            for block in val_loader:
                block = torch.nan_to_num(block.to(dev), nan=0.0)
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    p1 = model.module(block[:, 0])
                    p2 = model.module(p1)
                acc[0] += weighted_mse(p1.float(), block[:, 1], w_lat, valid)
                acc[1] += weighted_mse(p2.float(), block[:, 2], w_lat, valid)
                acc[2] += 1
        dist.all_reduce(acc)
        skipped = torch.tensor([n_skipped], device=dev)
        dist.all_reduce(skipped)
        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s | val mse 6h {acc[0] / acc[2]:.4f} "
                  f"12h {acc[1] / acc[2]:.4f} | skipped batches {int(skipped.item())}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
