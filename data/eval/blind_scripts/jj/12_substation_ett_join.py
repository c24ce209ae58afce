"""Oil-temperature forecasting for a fleet of substation transformers (ETT-style
CSVs, one per transformer). Each rank streams its own subset of transformers, so
ranks see different numbers of batches; DDP's Join handles the uneven ends.

    torchrun --standalone --nproc_per_node=8 12_substation_ett_join.py \
        --csv-dir /shared/ett_fleet --run-dir /shared/runs/ett_fleet_join
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset

COLS = ["HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--csv-dir", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--seq-len", type=int, default=336)
    p.add_argument("--pred-len", type=int, default=96)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    return p.parse_args()


class TransformerSeries(Dataset):
    """Windows of one transformer's series; scaling is that transformer's own train stats."""

    def __init__(self, path, split, seq_len, pred_len):
        arr = pd.read_csv(path)[COLS].to_numpy(np.float32)
        n = len(arr)
        a, b = int(0.6 * n), int(0.8 * n)
        mean, std = arr[:a].mean(0), arr[:a].std(0) + 1e-5
        lo, hi = {"train": (0, a), "val": (a - seq_len, b), "test": (b - seq_len, n)}[split]
        self.x = (arr[lo:hi] - mean) / std
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return max(0, len(self.x) - self.seq_len - self.pred_len + 1)

    def __getitem__(self, i):
        w = self.x[i:i + self.seq_len + self.pred_len]
        return torch.from_numpy(w[: self.seq_len]), torch.from_numpy(w[self.seq_len:])


class PatchTST(nn.Module):
    def __init__(self, a, n_vars):
        super().__init__()
        self.a = a
        n = (a.seq_len - a.patch) // a.stride + 1
        self.embed = nn.Linear(a.patch, a.d_model)
        self.pos = nn.Parameter(torch.zeros(1, n, a.d_model))
        layer = nn.TransformerEncoderLayer(a.d_model, 4, 2 * a.d_model, 0.2, batch_first=True,
                                           norm_first=True)
        self.enc = nn.TransformerEncoder(layer, a.layers, norm=nn.LayerNorm(a.d_model))
        self.head = nn.Linear(n * a.d_model, a.pred_len)
        self.n_vars = n_vars

    def forward(self, x):  # (B, L, C)
        B, L, C = x.shape
        m = x.mean(1, keepdim=True)
        s = x.std(1, keepdim=True) + 1e-5
        z = ((x - m) / s).permute(0, 2, 1).reshape(B * C, L)
        z = self.enc(self.embed(z.unfold(-1, self.a.patch, self.a.stride)) + self.pos)
        y = self.head(z.flatten(1)).view(B, C, -1).permute(0, 2, 1)
        return y * s + m

    @torch.no_grad()
    def forecast(self, x):
        self.eval()
        return self.forward(x)


def shard_loader(files, split, a, shuffle):
    ds = ConcatDataset([TransformerSeries(f, split, a.seq_len, a.pred_len) for f in files])
    return DataLoader(ds, batch_size=a.batch, shuffle=shuffle, num_workers=4, pin_memory=True,
                      drop_last=False)


def sum_errors(net, loader, device):
    tot = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        p = net.forecast(x)
        tot[0] += (p - y).pow(2).sum()
        tot[1] += (p - y).abs().sum()
        tot[2] += y.numel()
    dist.all_reduce(tot)
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2021)

    files = sorted(glob.glob(os.path.join(a.csv_dir, "*.csv")))
    assert len(files) >= world, f"need at least {world} transformers, found {len(files)}"
    mine = files[rank::world]
    train_dl = shard_loader(mine, "train", a, shuffle=True)
    val_dl = shard_loader(mine, "val", a, shuffle=False)
    test_dl = shard_loader(mine, "test", a, shuffle=False)

    net = PatchTST(a, len(COLS)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=a.lr * world)
    best_path = os.path.join(a.run_dir, "best.pt")
    if rank == 0:
        os.makedirs(a.run_dir, exist_ok=True)
        print(f"{len(files)} transformers over {world} ranks", flush=True)

    best, wait = float("inf"), 0
    for epoch in range(a.epochs):
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        with Join([model]):
            for x, y in train_dl:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.mse_loss(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                acc[0] += loss.detach() * x.shape[0]
                acc[1] += x.shape[0]
        dist.all_reduce(acc)

        val_mse, val_mae = sum_errors(net, val_dl, device)
        improved = val_mse < best
        if improved:
            best, wait = val_mse, 0
            if rank == 0:
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_mse": val_mse}, best_path)
        else:
            wait += 1
        if rank == 0:
            print(f"epoch {epoch:3d} train {acc[0].item() / acc[1].item():.4f} val mse {val_mse:.4f} "
                  f"mae {val_mae:.4f} {'*' if improved else ''} ({time.time() - t0:.0f}s)", flush=True)
        # val_mse is all-reduced, so every rank takes the same decision here
        if wait >= a.patience:
            break
        for g in opt.param_groups:
            g["lr"] = a.lr * world * (0.9 ** (epoch + 1))

    dist.barrier()  # best.pt fully written before anyone reads it
    state = torch.load(best_path, map_location=device)
    net.load_state_dict(state["model"])
    test_mse, test_mae = sum_errors(net, test_dl, device)
    if rank == 0:
        print(f"best epoch {state['epoch']} test mse {test_mse:.4f} mae {test_mae:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
