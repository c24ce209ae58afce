"""TSMixer (Chen et al. 2023) on the LTSF traffic benchmark (862 road occupancy sensors, hourly).

Time-mixing and feature-mixing MLPs with RevIN, trained with MSE on normalised data.

    torchrun --standalone --nproc_per_node=8 18_tsmixer_traffic.py --data data/traffic.csv --pred_len 336
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    parser = argparse.ArgumentParser("TSMixer")
    parser.add_argument("--data", type=str, default="data/traffic.csv")
    parser.add_argument("--checkpoints", type=str, default="./checkpoints/tsmixer")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--pred_len", type=int, default=96)
    parser.add_argument("--n_block", type=int, default=8)
    parser.add_argument("--ff_dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.7)
    parser.add_argument("--batch_size", type=int, default=32, help="per GPU")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--train_epochs", type=int, default=30)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class RevIN(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def norm(self, x):
        self._mean = x.mean(1, keepdim=True).detach()
        self._std = (x.var(1, keepdim=True, unbiased=False) + self.eps).sqrt().detach()
        return (x - self._mean) / self._std * self.weight + self.bias

    def denorm(self, x):
        return (x - self.bias) / (self.weight + self.eps ** 2) * self._std + self._mean


class MixerBlock(nn.Module):
    def __init__(self, seq_len, n_ch, ff_dim, dropout):
        super().__init__()
        self.norm_t = nn.LayerNorm([seq_len, n_ch])
        self.time_mlp = nn.Sequential(nn.Linear(seq_len, seq_len), nn.ReLU(), nn.Dropout(dropout))
        self.norm_f = nn.LayerNorm([seq_len, n_ch])
        self.feat_mlp = nn.Sequential(nn.Linear(n_ch, ff_dim), nn.ReLU(), nn.Dropout(dropout),
                                      nn.Linear(ff_dim, n_ch), nn.Dropout(dropout))

    def forward(self, x):
        # x: (B, L, C)
        x = x + self.time_mlp(self.norm_t(x).transpose(1, 2)).transpose(1, 2)
        return x + self.feat_mlp(self.norm_f(x))


class TSMixer(nn.Module):
    def __init__(self, seq_len, pred_len, n_ch, n_block, ff_dim, dropout):
        super().__init__()
        self.rev = RevIN(n_ch)
        self.blocks = nn.Sequential(*[MixerBlock(seq_len, n_ch, ff_dim, dropout) for _ in range(n_block)])
        self.temporal = nn.Linear(seq_len, pred_len)

    def forward(self, x):
        z = self.blocks(self.rev.norm(x))
        return self.rev.denorm(self.temporal(z.transpose(1, 2)).transpose(1, 2))


class LTSFWindows(Dataset):
    def __init__(self, arr, lo, hi, seq_len, pred_len):
        self.arr, self.seq_len, self.pred_len = arr, seq_len, pred_len
        self.n = hi - lo - seq_len - pred_len + 1
        self.lo = lo

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = self.lo + i
        return (torch.from_numpy(self.arr[s:s + self.seq_len]),
                torch.from_numpy(self.arr[s + self.seq_len:s + self.seq_len + self.pred_len]))


def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            d = net(x) - y
            acc[0] += (d ** 2).sum()
            acc[1] += d.abs().sum()
            acc[2] += d.numel()
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(2023)

    raw = pd.read_csv(args.data)
    arr = raw.drop(columns=["date"]).to_numpy(np.float32)
    n = len(arr)
    n_train, n_test = int(n * 0.7), int(n * 0.2)
    n_val = n - n_train - n_test
    mean, std = arr[:n_train].mean(0), arr[:n_train].std(0) + 1e-8
    arr = ((arr - mean) / std).astype(np.float32)

    train_ds = LTSFWindows(arr, 0, n_train, args.seq_len, args.pred_len)
    val_ds = LTSFWindows(arr, n_train - args.seq_len, n_train + n_val, args.seq_len, args.pred_len)
    test_ds = LTSFWindows(arr, n - n_test - args.seq_len, n, args.seq_len, args.pred_len)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=64,
                            num_workers=4, pin_memory=True)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=64,
                             num_workers=4, pin_memory=True)

    net = TSMixer(args.seq_len, args.pred_len, arr.shape[1], args.n_block, args.ff_dim, args.dropout).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.learning_rate * world)

    path = os.path.join(args.checkpoints, f"traffic_sl{args.seq_len}_pl{args.pred_len}")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        print(f"{arr.shape[1]} channels | train {len(train_ds)} val {len(val_ds)} test {len(test_ds)} | "
              f"world {world}", flush=True)

    best, counter = float("inf"), 0
    for epoch in range(args.train_epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        train_loss = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            train_loss += torch.stack([loss.detach(), torch.ones_like(loss)])
        dist.all_reduce(train_loss)

        vali_mse, vali_mae = evaluate(net, val_loader, device)
        if rank == 0:
            print(f"Epoch {epoch + 1} | {time.time() - t0:.1f}s | train {train_loss[0] / train_loss[1]:.5f} "
                  f"| vali mse {vali_mse:.5f} mae {vali_mae:.5f}", flush=True)
        if vali_mse < best:
            best, counter = vali_mse, 0
            if rank == 0:
                torch.save(net.state_dict(), os.path.join(path, "checkpoint.pth"))
        else:
            counter += 1
            if counter >= args.patience:
                if rank == 0:
                    print("Early stopping")
                break

    dist.barrier()
    net.load_state_dict(torch.load(os.path.join(path, "checkpoint.pth"), map_location=device))
    mse, mae = evaluate(net, test_loader, device)
    if rank == 0:
        print(f"test mse {mse:.4f} mae {mae:.4f}")
        with open("result_tsmixer.txt", "a") as f:
            f.write(f"traffic sl{args.seq_len} pl{args.pred_len}: mse {mse:.4f}, mae {mae:.4f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
