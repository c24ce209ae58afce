"""Vanilla encoder-decoder Transformer baseline on ETTh1 (multivariate -> multivariate).

Launched without torchrun: the script starts one process per visible GPU itself.

    python 14_transformer_etth1_spawn.py --csv data/ETT/ETTh1.csv --pred-len 336
    CUDA_VISIBLE_DEVICES=0,1 python 14_transformer_etth1_spawn.py --csv data/ETT/ETTh1.csv
"""
import argparse
import math
import os
import socket

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class ETTWindows(Dataset):
    def __init__(self, data, marks, lo, hi, seq_len, label_len, pred_len):
        self.data, self.marks = data, marks
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len
        self.starts = np.arange(lo, hi - seq_len - pred_len + 1)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        e = s + self.seq_len
        d0, d1 = e - self.label_len, e + self.pred_len
        return (torch.from_numpy(self.data[s:e]), torch.from_numpy(self.marks[s:e]),
                torch.from_numpy(self.data[d0:d1]), torch.from_numpy(self.marks[d0:d1]))


class TimeEmbedding(nn.Module):
    def __init__(self, c_in, n_marks, d_model, max_len=5000):
        super().__init__()
        self.value = nn.Conv1d(c_in, d_model, 3, padding=1, padding_mode="circular")
        self.marks = nn.Linear(n_marks, d_model)
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.drop = nn.Dropout(0.05)

    def forward(self, x, m):
        v = self.value(x.transpose(1, 2)).transpose(1, 2)
        return self.drop(v + self.marks(m) + self.pe[:, :x.shape[1]])


class Seq2SeqTransformer(nn.Module):
    def __init__(self, c_in, n_marks, d_model, n_heads, e_layers, d_layers, d_ff, pred_len):
        super().__init__()
        self.pred_len = pred_len
        self.enc_emb = TimeEmbedding(c_in, n_marks, d_model)
        self.dec_emb = TimeEmbedding(c_in, n_marks, d_model)
        self.transformer = nn.Transformer(d_model, n_heads, e_layers, d_layers, d_ff, dropout=0.05,
                                          batch_first=True, activation="gelu")
        self.proj = nn.Linear(d_model, c_in)

    def forward(self, x_enc, m_enc, x_dec, m_dec):
        dec_in = torch.cat([x_dec[:, :-self.pred_len], torch.zeros_like(x_dec[:, -self.pred_len:])], dim=1)
        t = dec_in.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x_enc.device), diagonal=1)
        out = self.transformer(self.enc_emb(x_enc, m_enc), self.dec_emb(dec_in, m_dec), tgt_mask=mask)
        return self.proj(out[:, -self.pred_len:])


def load_ett(path):
    df = pd.read_csv(path, parse_dates=["date"])
    values = df.drop(columns=["date"]).to_numpy(np.float32)
    d = df["date"].dt
    marks = np.stack([d.month / 12 - 0.5, d.day / 31 - 0.5, d.dayofweek / 6 - 0.5, d.hour / 23 - 0.5],
                     1).astype(np.float32)
    # 12/4/4 months, hourly
    b1, b2, b3 = 12 * 30 * 24, 16 * 30 * 24, 20 * 30 * 24
    mean, std = values[:b1].mean(0), values[:b1].std(0)
    return (values - mean) / std, marks, (b1, b2, b3)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def evaluate(net, loader, device, pred_len):
    net.eval()
    sq = torch.zeros(pred_len, device=device, dtype=torch.float64)
    ab = torch.zeros(pred_len, device=device, dtype=torch.float64)
    n = torch.zeros((), device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, mx, y, my in loader:
            x, mx, y, my = (t.to(device, non_blocking=True) for t in (x, mx, y, my))
            err = net(x, mx, y, my) - y[:, -pred_len:]
            sq += (err ** 2).sum(dim=(0, 2)).double()
            ab += err.abs().sum(dim=(0, 2)).double()
            n += err.shape[0] * err.shape[2]
    for t in (sq, ab, n):
        dist.all_reduce(t)
    net.train()
    return (sq / n).cpu().numpy(), (ab / n).cpu().numpy()


def worker(rank, world_size, port, args, data, marks, borders):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    b1, b2, b3 = borders
    mk = lambda lo, hi: ETTWindows(data, marks, lo, hi, args.seq_len, args.label_len, args.pred_len)
    train_ds, val_ds, test_ds = mk(0, b1), mk(b1 - args.seq_len, b2), mk(b2 - args.seq_len, b3)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size // world_size, sampler=sampler, num_workers=2,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    shard = lambda ds: DataLoader(Subset(ds, range(rank, len(ds), world_size)), batch_size=128, num_workers=2)
    val_loader, test_loader = shard(val_ds), shard(test_ds)

    net = Seq2SeqTransformer(data.shape[1], marks.shape[1], args.d_model, args.n_heads, args.e_layers,
                             args.d_layers, args.d_ff, args.pred_len).to(device)
    model = DDP(net, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ckpt = os.path.join(args.out, f"etth1_pl{args.pred_len}.pt")

    best, bad = float("inf"), 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, mx, y, my in train_loader:
            x, mx, y, my = (t.to(device, non_blocking=True) for t in (x, mx, y, my))
            loss = nn.functional.mse_loss(model(x, mx, y, my), y[:, -args.pred_len:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for g in opt.param_groups:  # type1 schedule from the Informer code base
            g["lr"] = args.lr * 0.5 ** (epoch + 1)

        val_mse = float(evaluate(net, val_loader, device, args.pred_len)[0].mean())
        if rank == 0:
            print(f"epoch {epoch + 1}: train {loss.item():.4f} val mse {val_mse:.4f}", flush=True)
        if val_mse < best:
            best, bad = val_mse, 0
            if rank == 0:
                torch.save(net.state_dict(), ckpt)
        else:
            bad += 1
        if bad >= args.patience:
            break

    dist.barrier()
    net.load_state_dict(torch.load(ckpt, map_location={"cuda:0": f"cuda:{rank}"}))
    mse, mae = evaluate(net, test_loader, device, args.pred_len)
    if rank == 0:
        pd.DataFrame({"step": np.arange(1, args.pred_len + 1), "mse": mse, "mae": mae}).to_csv(
            os.path.join(args.out, f"etth1_pl{args.pred_len}_per_step.csv"), index=False)
        print(f"test mse {mse.mean():.4f} mae {mae.mean():.4f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/ETT/ETTh1.csv")
    ap.add_argument("--out", default="runs/transformer_etth1")
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--label-len", type=int, default=48)
    ap.add_argument("--pred-len", type=int, default=96)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--e-layers", type=int, default=2)
    ap.add_argument("--d-layers", type=int, default=1)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=64, help="global, split across the GPUs")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--seed", type=int, default=2021)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    data, marks, borders = load_ett(args.csv)
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, free_port(), args, data, marks, borders), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
