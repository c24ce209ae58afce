"""DLinear (Zeng et al. 2023) on the daily exchange-rate panel (8 currencies, 1990-2016).

Moving-average decomposition into trend + remainder, one linear map per component,
shared across channels (or one per channel with --individual).

    torchrun --nproc_per_node=2 15_dlinear_exchange_rate.py --csv data/exchange_rate.csv --pred-len 192
"""
import argparse
import logging
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("dlinear")


class MovingAvg(nn.Module):
    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel
        self.avg = nn.AvgPool1d(kernel, stride=1)

    def forward(self, x):
        # x (B, L, C); replicate both ends so the output keeps length L
        front = x[:, :1].repeat(1, (self.kernel - 1) // 2, 1)
        end = x[:, -1:].repeat(1, (self.kernel - 1) // 2, 1)
        x = torch.cat([front, x, end], dim=1)
        return self.avg(x.transpose(1, 2)).transpose(1, 2)


class DLinear(nn.Module):
    def __init__(self, seq_len, pred_len, channels, kernel=25, individual=False):
        super().__init__()
        self.decomp = MovingAvg(kernel)
        self.individual = individual
        n = channels if individual else 1
        self.seasonal = nn.ModuleList(nn.Linear(seq_len, pred_len) for _ in range(n))
        self.trend = nn.ModuleList(nn.Linear(seq_len, pred_len) for _ in range(n))

    def forward(self, x):
        trend = self.decomp(x)
        seasonal = (x - trend).transpose(1, 2)
        trend = trend.transpose(1, 2)
        if self.individual:
            out = torch.stack([self.seasonal[i](seasonal[:, i]) + self.trend[i](trend[:, i])
                               for i in range(len(self.seasonal))], dim=1)
        else:
            out = self.seasonal[0](seasonal) + self.trend[0](trend)
        return out.transpose(1, 2)


class Windows(Dataset):
    def __init__(self, arr, lo, hi, seq_len, pred_len):
        self.arr, self.seq_len, self.pred_len = arr, seq_len, pred_len
        self.starts = np.arange(lo, hi - seq_len - pred_len + 1)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.arr[s:s + self.seq_len]
        y = self.arr[s + self.seq_len:s + self.seq_len + self.pred_len]
        return torch.from_numpy(x), torch.from_numpy(y)


def evaluate(model, loader, device):
    model.eval()
    total_mse, total_mae, count = 0.0, 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            pred = model(x)
            total_mse += ((pred - y) ** 2).sum().item()
            total_mae += (pred - y).abs().sum().item()
            count += y.numel()
    stats = torch.tensor([total_mse, total_mae, float(count)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/exchange_rate.csv")
    ap.add_argument("--out", default="runs/dlinear_exchange")
    ap.add_argument("--seq-len", type=int, default=336)
    ap.add_argument("--pred-len", type=int, default=96)
    ap.add_argument("--kernel", type=int, default=25)
    ap.add_argument("--individual", action="store_true")
    ap.add_argument("--batch-size", type=int, default=32, help="global")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--patience", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(2021)

    df = pd.read_csv(args.csv)
    arr = df.drop(columns=[c for c in df.columns if c in ("date", "OT_date")]).to_numpy(np.float32)
    n = len(arr)
    n_train, n_test = int(n * 0.7), int(n * 0.2)
    n_val = n - n_train - n_test
    mu, sd = arr[:n_train].mean(0), arr[:n_train].std(0)
    arr = ((arr - mu) / sd).astype(np.float32)

    L, H = args.seq_len, args.pred_len
    train_ds = Windows(arr, 0, n_train, L, H)
    val_ds = Windows(arr, n_train - L, n_train + n_val, L, H)
    test_ds = Windows(arr, n - n_test - L, n, L, H)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=max(args.batch_size // world, 1), sampler=sampler,
                              drop_last=True, num_workers=2)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=256)

    net = DLinear(L, H, arr.shape[1], args.kernel, args.individual).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, f"dlinear_{L}_{H}.pt")
    log.info("%d/%d/%d windows, %d channels, %d ranks", len(train_ds), len(val_ds), len(test_ds),
             arr.shape[1], world)

    best, wait = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        for g in opt.param_groups:
            g["lr"] = args.lr * 0.5 ** (epoch + 1)

        val_mse, val_mae = evaluate(net, val_loader, device)
        log.info("epoch %d: val mse %.4f mae %.4f", epoch + 1, val_mse, val_mae)
        if val_mse < best:
            best, wait = val_mse, 0
            if rank == 0:
                torch.save(net.state_dict(), ckpt_path)
        else:
            wait += 1
            if wait >= args.patience:
                log.info("early stopping")
                break

    dist.barrier()
    net.load_state_dict(torch.load(ckpt_path, map_location=device))
    test_mse, test_mae = evaluate(net, test_loader, device)
    if rank == 0:
        log.info("test mse %.4f mae %.4f", test_mse, test_mae)
        row = pd.DataFrame([{"seq_len": L, "pred_len": H, "individual": args.individual,
                             "mse": test_mse, "mae": test_mae}])
        res = os.path.join(args.out, "results.csv")
        row.to_csv(res, mode="a", header=not os.path.exists(res), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
