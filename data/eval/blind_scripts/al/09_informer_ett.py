"""Informer-style encoder/decoder (distilling encoder, generative decoder) for ETTh1/ETTm1.

Example:
    torchrun --nproc_per_node=4 09_informer_ett.py --data ETTh1 --root_path ./data/ETT/ --features M
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    parser = argparse.ArgumentParser(description="Informer long sequence forecasting")
    parser.add_argument("--data", type=str, default="ETTh1")
    parser.add_argument("--root_path", type=str, default="./data/ETT/")
    parser.add_argument("--features", type=str, default="M", choices=["M", "S"])
    parser.add_argument("--target", type=str, default="OT")
    parser.add_argument("--seq_len", type=int, default=96)
    parser.add_argument("--label_len", type=int, default=48)
    parser.add_argument("--pred_len", type=int, default=24)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--n_heads", type=int, default=8)
    parser.add_argument("--e_layers", type=int, default=2)
    parser.add_argument("--d_layers", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.05)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--train_epochs", type=int, default=6)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--checkpoints", type=str, default="./checkpoints/")
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class ETTHour(Dataset):
    def __init__(self, root, name, flag, size, features, target):
        self.seq_len, self.label_len, self.pred_len = size
        df = pd.read_csv(os.path.join(root, f"{name}.csv"))
        if name.startswith("ETTm"):
            b1 = [0, 12 * 30 * 24 * 4 - self.seq_len, 12 * 30 * 24 * 4 + 4 * 30 * 24 * 4 - self.seq_len]
            b2 = [12 * 30 * 24 * 4, 12 * 30 * 24 * 4 + 4 * 30 * 24 * 4, 12 * 30 * 24 * 4 + 8 * 30 * 24 * 4]
        else:
            b1 = [0, 12 * 30 * 24 - self.seq_len, 12 * 30 * 24 + 4 * 30 * 24 - self.seq_len]
            b2 = [12 * 30 * 24, 12 * 30 * 24 + 4 * 30 * 24, 12 * 30 * 24 + 8 * 30 * 24]
        i = {"train": 0, "val": 1, "test": 2}[flag]
        cols = df.columns[1:] if features == "M" else [target]
        data = df[cols].values
        self.scaler = StandardScaler().fit(data[b1[0]:b2[0]])
        data = self.scaler.transform(data)
        stamp = pd.to_datetime(df["date"])
        marks = np.stack([stamp.dt.month, stamp.dt.day, stamp.dt.weekday, stamp.dt.hour], 1)
        self.x = data[b1[i]:b2[i]].astype(np.float32)
        self.mark = marks[b1[i]:b2[i]].astype(np.int64)

    def __len__(self):
        return len(self.x) - self.seq_len - self.pred_len + 1

    def __getitem__(self, idx):
        s_end = idx + self.seq_len
        r_begin = s_end - self.label_len
        r_end = s_end + self.pred_len
        return self.x[idx:s_end], self.x[r_begin:r_end], self.mark[idx:s_end], self.mark[r_begin:r_end]


class TemporalEmbedding(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.month, self.day = nn.Embedding(13, d), nn.Embedding(32, d)
        self.weekday, self.hour = nn.Embedding(7, d), nn.Embedding(24, d)

    def forward(self, m):
        return self.month(m[..., 0]) + self.day(m[..., 1]) + self.weekday(m[..., 2]) + self.hour(m[..., 3])


class DataEmbedding(nn.Module):
    def __init__(self, c_in, d, dropout, max_len=5000):
        super().__init__()
        self.value = nn.Conv1d(c_in, d, 3, padding=1, padding_mode="circular")
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d, 2).float() * -(np.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.temporal = TemporalEmbedding(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, m):
        v = self.value(x.transpose(1, 2)).transpose(1, 2)
        return self.drop(v + self.pe[:, : x.shape[1]] + self.temporal(m))


class DistilConv(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1, padding_mode="circular")
        self.norm = nn.LayerNorm(d)
        self.pool = nn.MaxPool1d(3, 2, 1)

    def forward(self, x):
        y = torch.nn.functional.elu(self.norm(self.conv(x.transpose(1, 2)).transpose(1, 2)))
        return self.pool(y.transpose(1, 2)).transpose(1, 2)


class Informer(nn.Module):
    def __init__(self, c_in, c_out, pred_len, d, h, e_layers, d_layers, dropout):
        super().__init__()
        self.pred_len = pred_len
        self.enc_emb = DataEmbedding(c_in, d, dropout)
        self.dec_emb = DataEmbedding(c_in, d, dropout)
        self.enc = nn.ModuleList([nn.TransformerEncoderLayer(d, h, 4 * d, dropout, batch_first=True, activation="gelu")
                                  for _ in range(e_layers)])
        self.distil = nn.ModuleList([DistilConv(d) for _ in range(e_layers - 1)])
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, h, 4 * d, dropout, batch_first=True,
                                                                    activation="gelu"), d_layers)
        self.proj = nn.Linear(d, c_out)

    def forward(self, x_enc, m_enc, x_dec, m_dec):
        z = self.enc_emb(x_enc, m_enc)
        for i, layer in enumerate(self.enc):
            z = layer(z)
            if i < len(self.distil):
                z = self.distil[i](z)
        y = self.dec_emb(x_dec, m_dec)
        L = y.shape[1]
        causal = torch.triu(torch.full((L, L), float("-inf"), device=y.device), diagonal=1)
        y = self.dec(y, z, tgt_mask=causal)
        return self.proj(y)[:, -self.pred_len:]


def make_dec_input(batch_y, label_len, pred_len):
    zeros = torch.zeros_like(batch_y[:, -pred_len:])
    return torch.cat([batch_y[:, :label_len], zeros], 1)


@torch.no_grad()
def evaluate(model, loader, args, device):
    model.eval()
    tot = torch.zeros(3, device=device, dtype=torch.float64)
    for bx, by, mx, my in loader:
        bx, by, mx, my = bx.to(device), by.to(device), mx.to(device), my.to(device)
        out = model(bx, mx, make_dec_input(by, args.label_len, args.pred_len), my)
        tgt = by[:, -args.pred_len:]
        tot[0] += ((out - tgt) ** 2).sum()
        tot[1] += (out - tgt).abs().sum()
        tot[2] += tgt.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(2021)

    size = (args.seq_len, args.label_len, args.pred_len)
    sets = {f: ETTHour(args.root_path, args.data, f, size, args.features, args.target) for f in ("train", "val", "test")}
    train_sampler = DistributedSampler(sets["train"], shuffle=True, drop_last=True)
    loaders = {"train": DataLoader(sets["train"], batch_size=args.batch_size, sampler=train_sampler,
                                   num_workers=args.num_workers, pin_memory=True, drop_last=True)}
    for f in ("val", "test"):
        # every rank scores a disjoint slice of the windows, no padding
        part = Subset(sets[f], range(rank, len(sets[f]), world_size))
        loaders[f] = DataLoader(part, batch_size=args.batch_size, shuffle=False, num_workers=args.num_workers)

    c = sets["train"].x.shape[1]
    model = Informer(c, c, args.pred_len, args.d_model, args.n_heads, args.e_layers, args.d_layers, args.dropout)
    model = DDP(model.to(device), device_ids=[args.local_rank], output_device=args.local_rank)
    optim = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    criterion = nn.MSELoss()

    setting = f"informer_{args.data}_ft{args.features}_sl{args.seq_len}_ll{args.label_len}_pl{args.pred_len}"
    ckpt_dir = os.path.join(args.checkpoints, setting)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    best_val, bad_epochs = float("inf"), 0

    for epoch in range(args.train_epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for i, (bx, by, mx, my) in enumerate(loaders["train"]):
            bx, by = bx.to(device, non_blocking=True), by.to(device, non_blocking=True)
            mx, my = mx.to(device, non_blocking=True), my.to(device, non_blocking=True)
            optim.zero_grad()
            out = model(bx, mx, make_dec_input(by, args.label_len, args.pred_len), my)
            loss = criterion(out, by[:, -args.pred_len:])
            loss.backward()
            optim.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and (i + 1) % 100 == 0:
                print(f"\titers: {i + 1}, epoch: {epoch + 1} | loss: {loss.item():.7f}")

        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()
        val_mse, _ = evaluate(model.module, loaders["val"], args, device)
        test_mse, test_mae = evaluate(model.module, loaders["test"], args, device)
        if rank == 0:
            print(f"Epoch: {epoch + 1} cost {time.time() - t0:.1f}s | Train {train_loss:.7f} "
                  f"Vali {val_mse:.7f} Test {test_mse:.7f} / {test_mae:.7f}")
        if val_mse < best_val:
            best_val, bad_epochs = val_mse, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "checkpoint.pth"))
        else:
            bad_epochs += 1
        if bad_epochs >= args.patience:
            if rank == 0:
                print("Early stopping")
            break
        for g in optim.param_groups:  # type1 lr schedule
            g["lr"] = args.learning_rate * (0.5 ** epoch)
        dist.barrier()

    dist.barrier()
    state = torch.load(os.path.join(ckpt_dir, "checkpoint.pth"), map_location=device)
    model.module.load_state_dict(state)
    test_mse, test_mae = evaluate(model.module, loaders["test"], args, device)
    if rank == 0:
        print(f"final test mse:{test_mse:.7f}, mae:{test_mae:.7f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
