"""PatchTST-style channel-independent transformer for solar power forecasting.

Data: NREL Alabama solar, 137 PV plants at 10-minute resolution (one column per plant).
Cutting the windows over all plants is slow, so the arrays are cached as an .npz
in --cache-dir and reused by later runs with the same window sizes.

    torchrun --nproc_per_node=4 05_patchtst_solar.py --csv data/solar_AL.csv --horizon 144
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/solar_AL.csv")
    p.add_argument("--cache-dir", default="data/cache")
    p.add_argument("--out", default="runs/patchtst_solar")
    p.add_argument("--input-len", type=int, default=432)
    p.add_argument("--horizon", type=int, default=144)
    p.add_argument("--patch-len", type=int, default=16)
    p.add_argument("--patch-stride", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=5)
    return p.parse_args()


class PatchTST(nn.Module):
    def __init__(self, input_len, horizon, patch_len, stride, d_model, n_heads, n_layers, dropout):
        super().__init__()
        self.patch_len, self.stride = patch_len, stride
        n_patches = (input_len - patch_len) // stride + 2  # +1 for the end padding patch
        self.pad = nn.ReplicationPad1d((0, stride))
        self.proj = nn.Linear(patch_len, d_model)
        self.pos = nn.Parameter(torch.randn(1, n_patches, d_model) * 0.02)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, n_layers)
        self.head = nn.Sequential(nn.Flatten(1), nn.Dropout(dropout), nn.Linear(n_patches * d_model, horizon))

    def forward(self, x):
        # x: (B, L) one channel at a time; RevIN-style instance normalisation
        mu = x.mean(1, keepdim=True)
        sd = x.std(1, keepdim=True) + 1e-5
        z = self.pad(((x - mu) / sd).unsqueeze(1)).squeeze(1)
        patches = z.unfold(-1, self.patch_len, self.stride)
        h = self.encoder(self.drop(self.proj(patches) + self.pos))
        return self.head(h) * sd + mu


def build_windows(csv_path, input_len, horizon):
    df = pd.read_csv(csv_path, header=None)
    power = df.to_numpy(np.float32)  # (T, plants), MW
    T, n_plants = power.shape
    n_train, n_val = int(T * 0.7), int(T * 0.1)
    # capacity scaling per plant, fitted on the training part
    cap = power[:n_train].max(axis=0) + 1e-3
    power = power / cap

    def cut(t_lo, t_hi, step):
        xs, ys = [], []
        for t in range(t_lo, t_hi - input_len - horizon + 1, step):
            xs.append(power[t:t + input_len].T)
            ys.append(power[t + input_len:t + input_len + horizon].T)
        return np.concatenate(xs), np.concatenate(ys)

    x_tr, y_tr = cut(0, n_train, 6)
    x_va, y_va = cut(n_train - input_len, n_train + n_val, horizon)
    x_te, y_te = cut(n_train + n_val - input_len, T, horizon)
    return dict(x_tr=x_tr, y_tr=y_tr, x_va=x_va, y_va=y_va, x_te=x_te, y_te=y_te, cap=cap)


def load_cached(args):
    os.makedirs(args.cache_dir, exist_ok=True)
    name = os.path.splitext(os.path.basename(args.csv))[0]
    path = os.path.join(args.cache_dir, f"{name}_L{args.input_len}_H{args.horizon}.npz")
    if not os.path.exists(path):
        arrays = build_windows(args.csv, args.input_len, args.horizon)
        np.savez(path, **arrays)
    return dict(np.load(path))


def shard(x, y, rank, world):
    return TensorDataset(torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world]))


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        p = net(x)
        s[0] += ((p - y) ** 2).sum()
        s[1] += (p - y).abs().sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = load_cached(args)
    train_ds = TensorDataset(torch.from_numpy(data["x_tr"]), torch.from_numpy(data["y_tr"]))
    val_ds = shard(data["x_va"], data["y_va"], rank, world)
    test_ds = shard(data["x_te"], data["y_te"], rank, world)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, 4 * args.batch_size, num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_ds, 4 * args.batch_size, num_workers=2, pin_memory=True)

    torch.manual_seed(2024)
    net = PatchTST(args.input_len, args.horizon, args.patch_len, args.patch_stride, args.d_model,
                   args.n_heads, args.n_layers, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-4)
    total_steps = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world, total_steps=total_steps,
                                                pct_start=0.3)
    loss_fn = nn.MSELoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train windows {len(train_ds)}, steps/epoch {len(train_loader)}, world {world}")
    best, bad = math.inf, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        val_mse, val_mae = evaluate(net, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_mse {val_mse:.5f} val_mae {val_mae:.5f} ({time.time() - t0:.0f}s)",
                  flush=True)
        if val_mse < best:
            best, bad = val_mse, 0
            if rank == 0:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        else:
            bad += 1
            if bad >= args.patience:
                break

    dist.barrier()
    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    test_mse, test_mae = evaluate(net, test_loader, device)
    if rank == 0:
        print(f"test mse {test_mse:.5f} mae {test_mae:.5f} (capacity-normalised)")
        pd.DataFrame([{"horizon": args.horizon, "val_mse": best, "test_mse": test_mse,
                       "test_mae": test_mae}]).to_csv(os.path.join(args.out, "metrics.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
