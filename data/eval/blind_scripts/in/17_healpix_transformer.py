"""Transformer on a HEALPix (nside=64, nested) remap of ERA5, 12 h steps, 4-step rollout loss.

Pixels are equal-area, so the area-weighted RMSE is the plain mean over pixels.
Tokens are groups of 16 nested pixels (nside 64 -> 3072 tokens).

    torchrun --nproc_per_node=4 17_healpix_transformer.py --store /data/era5_hpx64.zarr
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import xarray as xr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger("hpx")
NSIDE = 64
NPIX = 12 * NSIDE * NSIDE
GROUP = 16


class HpxSequence(Dataset):
    def __init__(self, store, start, end, steps, mean, std, stride=2):
        ds = xr.open_zarr(store).sel(time=slice(start, end))
        self.x = ds["state"]          # (time, channel, pixel), 6-hourly
        self.steps, self.stride = steps, stride
        self.n = self.x.sizes["time"]
        self.mean, self.std = mean[:, None], std[:, None]

    def __len__(self):
        return self.n - self.steps * self.stride

    def __getitem__(self, i):
        seq = self.x.isel(time=slice(i, i + self.steps * self.stride + 1, self.stride)).values
        seq = (seq.astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(seq)


class HpxTransformer(nn.Module):
    def __init__(self, ch, dim=768, depth=12, heads=12):
        super().__init__()
        self.ch = ch
        self.n_tok = NPIX // GROUP
        self.inp = nn.Linear(ch * GROUP, dim)
        self.pos = nn.Parameter(torch.zeros(1, self.n_tok, dim))
        self.face = nn.Embedding(12, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, ch * GROUP)
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        # x: (B, C, NPIX) in nested ordering -> tokens of 16 neighbouring pixels
        B, C, P = x.shape
        t = x.view(B, C, self.n_tok, GROUP).permute(0, 2, 1, 3).reshape(B, self.n_tok, C * GROUP)
        face_id = torch.arange(self.n_tok, device=x.device) // (self.n_tok // 12)
        h = self.inp(t) + self.pos + self.face(face_id)
        h = self.out(self.norm(self.enc(h)))
        d = h.view(B, self.n_tok, C, GROUP).permute(0, 2, 1, 3).reshape(B, C, P)
        return x + d


def run_rollout(model, seq, steps):
    x, preds = seq[:, 0], []
    for _ in range(steps):
        x = model(x)
        preds.append(x)
    return torch.stack(preds, dim=1)


@torch.no_grad()
def validate(net, loader, std, steps, device):
    net.eval()
    acc = torch.zeros(steps, std.shape[1] + 1, dtype=torch.float64, device=device)
    for seq in loader:
        seq = seq.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = run_rollout(net, seq, steps).float()
        rmse = (((preds - seq[:, 1:]) * std) ** 2).mean(-1).sqrt()       # (B, steps, C)
        acc[:, :-1] += rmse.sum(0).double()
        acc[:, -1] += seq.shape[0]
    dist.all_reduce(acc)
    net.train()
    return acc[:, :-1] / acc[:, -1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", default="runs/hpx64")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=4e-4, help="for batch 32")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    st = xr.open_zarr(args.store)
    mean = st["mean"].values.astype(np.float32)
    std = st["std"].values.astype(np.float32)
    names = [str(c) for c in st["channel"].values]
    train_ds = HpxSequence(args.store, "1979-01-01", "2014-12-31", args.steps, mean, std)
    val_full = HpxSequence(args.store, "2016-01-01", "2017-12-31", args.steps, mean, std)
    val_ds = Subset(val_full, range(rank, len(val_full), 2 * world))

    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, num_workers=4, pin_memory=True)

    net = HpxTransformer(len(mean)).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 32
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, s / total))))
    std_t = torch.from_numpy(std).to(device).view(1, 1, -1, 1)
    tb = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tb = SummaryWriter(args.out)
        logger.info("train %d samples, %d steps/epoch, lr %.2e", len(train_ds), len(train_dl), lr)

    gstep = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for seq in train_dl:
            seq = seq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                preds = run_rollout(model, seq, args.steps)
            loss = ((preds.float() - seq[:, 1:]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            gstep += 1
            if tb is not None and gstep % 50 == 0:
                tb.add_scalar("train/loss", loss.item(), gstep)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], gstep)

        rmse = validate(net, val_dl, std_t, args.steps, device)
        if rank == 0:
            for name in ("z500", "t850", "t2m"):
                c = names.index(name)
                for k in range(args.steps):
                    tb.add_scalar(f"val/{name}_{12 * (k + 1)}h", rmse[k, c].item(), epoch)
            logger.info("epoch %d %.0fs z500@48h %.1f", epoch, time.time() - t0,
                        rmse[-1, names.index("z500")].item())
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "channels": names}, os.path.join(args.out, "ckpt.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
