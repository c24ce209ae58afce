"""iTransformer (variates as tokens) on PEMS traffic (862 sensors, hourly).

At the end, the full test-set forecasts are gathered on rank 0 and written to disk for the
per-horizon / per-sensor analysis notebooks.

    torchrun --nproc_per_node=4 19_itransformer_traffic.py --csv data/traffic.csv --pred-len 96
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


class Windows(Dataset):
    def __init__(self, data, marks, seq_len, pred_len):
        self.data = torch.from_numpy(data).float()
        self.marks = torch.from_numpy(marks).float()
        self.seq_len, self.pred_len = seq_len, pred_len

    def __len__(self):
        return len(self.data) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        e = i + self.seq_len
        return self.data[i:e], self.marks[i:e], self.data[e:e + self.pred_len]


def time_marks(index):
    idx = pd.DatetimeIndex(index)
    return np.stack([idx.hour / 23.0 - 0.5, idx.dayofweek / 6.0 - 0.5,
                     (idx.day - 1) / 30.0 - 0.5, (idx.dayofyear - 1) / 365.0 - 0.5], 1).astype(np.float32)


def build(csv, seq_len, pred_len):
    df = pd.read_csv(csv)
    marks = time_marks(df["date"])
    values = df.drop(columns=["date"]).to_numpy(np.float32)
    n = len(values)
    n_tr, n_te = int(0.7 * n), int(0.2 * n)
    n_va = n - n_tr - n_te
    mu, sd = values[:n_tr].mean(0), values[:n_tr].std(0) + 1e-6
    values = (values - mu) / sd
    b = [(0, n_tr), (n_tr - seq_len, n_tr + n_va), (n - n_te - seq_len, n)]
    return [Windows(values[s:e], marks[s:e], seq_len, pred_len) for s, e in b], values.shape[1]


class ITransformer(nn.Module):
    def __init__(self, seq_len, pred_len, n_marks=4, d_model=512, n_heads=8, e_layers=4, d_ff=512, dropout=0.1):
        super().__init__()
        self.embed = nn.Linear(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, e_layers, norm=nn.LayerNorm(d_model))
        self.proj = nn.Linear(d_model, pred_len)

    def forward(self, x, marks):
        # per-instance normalisation (non-stationary transformer trick)
        mean = x.mean(1, keepdim=True).detach()
        std = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5).detach()
        x = (x - mean) / std
        n_vars = x.shape[2]
        tokens = torch.cat([x, marks], 2).permute(0, 2, 1)     # B, N + n_marks, L
        h = self.encoder(self.drop(self.embed(tokens)))
        y = self.proj(h).permute(0, 2, 1)[:, :, :n_vars]       # B, H, N
        return y * std + mean


@torch.no_grad()
def predict(net, loader, device):
    net.eval()
    preds, trues = [], []
    for x, m, y in loader:
        x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = net(x, m)
        preds.append(p.float())
        trues.append(y.to(device))
    net.train()
    return torch.cat(preds), torch.cat(trues)


def reduced_metrics(pred, true):
    s = torch.stack([((pred - true) ** 2).sum(), (pred - true).abs().sum(),
                     torch.tensor(float(true.numel()), device=pred.device)]).double()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--pred-len", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", default="results/itransformer_traffic")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2023)

    (train_ds, val_ds, test_ds), n_vars = build(args.csv, args.seq_len, args.pred_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    # contiguous blocks so that rank order == time order when the shards are concatenated
    per = -(-len(test_ds) // world)
    test_part = Subset(test_ds, range(rank * per, min(len(test_ds), (rank + 1) * per)))
    val_part = Subset(val_ds, range(rank, len(val_ds), world))
    val_dl = DataLoader(val_part, 64, num_workers=2, pin_memory=True)
    test_dl = DataLoader(test_part, 64, num_workers=2, pin_memory=True)

    net = ITransformer(args.seq_len, args.pred_len).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
    crit = nn.MSELoss()

    os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, m, y in train_dl:
            x, m, y = x.to(device, non_blocking=True), m.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x, m)
            loss = crit(out.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(run)

        vp, vt = predict(net, val_dl, device)
        v_mse, v_mae = reduced_metrics(vp, vt)
        if rank == 0:
            print(f"epoch {epoch + 1}: train {(run[0] / run[1]).item():.4f} val mse {v_mse:.4f} mae {v_mae:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if v_mse < best:
                torch.save(net.state_dict(), os.path.join(args.out, "best.pth"))
        best = min(best, v_mse)
        dist.barrier()

    net.load_state_dict(torch.load(os.path.join(args.out, "best.pth"), map_location=device))
    tp, tt = predict(net, test_dl, device)
    t_mse, t_mae = reduced_metrics(tp, tt)

    gathered = [torch.zeros_like(tp) for _ in range(world)]
    dist.all_gather(gathered, tp)
    if rank == 0:
        full = torch.cat(gathered).cpu().numpy()
        np.save(os.path.join(args.out, "test_pred.npy"), full)
        print(f"test mse {t_mse:.4f} mae {t_mae:.4f}; saved predictions {full.shape}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
