"""PatchTST-style long-horizon forecaster, DDP + torch.compile, trained on many series.

    torchrun --nproc_per_node=4 patchtst_compile_ddp.py --data /shared/ts/electricity.npy --out /shared/ts_runs/ecl
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SeriesWindows(Dataset):
    """All (series, start) windows of one split; data is [num_series, T] float32."""

    def __init__(self, data, context, horizon, t0, t1, stride=1):
        self.data = data
        self.context, self.horizon = context, horizon
        starts = np.arange(t0, t1 - context - horizon + 1, stride)
        self.index = [(s, t) for s in range(data.shape[0]) for t in starts]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, t = self.index[i]
        w = self.data[s, t : t + self.context + self.horizon]
        return torch.from_numpy(w[: self.context].copy()), torch.from_numpy(w[self.context :].copy())


class PatchTST(nn.Module):
    def __init__(self, context=512, horizon=96, patch=16, stride=8, d_model=128, n_heads=16, n_layers=3, dropout=0.2):
        super().__init__()
        self.patch, self.stride = patch, stride
        n_patches = (context - patch) // stride + 2
        self.embed = nn.Linear(patch, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 2 * d_model, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Flatten(1), nn.Dropout(dropout), nn.Linear(n_patches * d_model, horizon))

    def forward(self, x):
        # instance normalisation (RevIN without affine)
        mean = x.mean(dim=1, keepdim=True)
        std = x.std(dim=1, keepdim=True) + 1e-5
        z = (x - mean) / std
        z = torch.cat([z, z[:, -1:].expand(-1, self.stride)], dim=1)
        patches = z.unfold(1, self.patch, self.stride)
        h = self.encoder(self.embed(patches) + self.pos)
        return self.head(h) * std + mean


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--horizon", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = model(x)
        acc[0] += ((pred - y) ** 2).sum()
        acc[1] += (pred - y).abs().sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])

    # every rank has to use the same seed for model init and the split
    seed = torch.tensor([args.seed if args.seed >= 0 else random.randint(0, 2**31 - 1)], device="cuda")
    dist.broadcast(seed, src=0)
    seed = int(seed.item())
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(seed)
    np.random.seed(seed)

    data = np.load(args.data).astype(np.float32)  # [num_series, T]
    T = data.shape[1]
    t_train, t_val = int(0.7 * T), int(0.8 * T)
    train_ds = SeriesWindows(data, args.context, args.horizon, 0, t_train)
    val_ds = SeriesWindows(data, args.context, args.horizon, t_train - args.context, t_val, stride=args.horizon)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=1024, sampler=val_sampler, num_workers=2, pin_memory=True)

    model = PatchTST(context=args.context, horizon=args.horizon).to(device)
    raw_model = model
    model = torch.compile(DDP(model, device_ids=[local_rank]))
    optimizer = torch.optim.Adam(raw_model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_dl), pct_start=0.3)
    loss_fn = nn.MSELoss()

    best, bad_epochs = float("inf"), 0
    os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        mse, mae = evaluate(model, val_dl, device)

        # all ranks see the same reduced numbers, so they take the same early-stopping decision
        if mse < best:
            best, bad_epochs = mse, 0
            if rank == 0:
                torch.save({"model": raw_model.state_dict(), "epoch": epoch, "val_mse": mse, "seed": seed},
                           os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch} train {(run[0] / run[1]).item():.4f} val mse {mse:.4f} mae {mae:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()
        if bad_epochs >= args.patience:
            break

    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"best_val_mse": best, "seed": seed, "world_size": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
