# Informer-style encoder/decoder for multivariate gas-turbine sensor forecasting.
#
#   torchrun --standalone --nproc_per_node=4 03_informer_turbine.py \
#       --root /shared/datasets/turbine --features M --target exhaust_temp
#
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("informer")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--file", default="turbine_10min.csv")
    ap.add_argument("--features", default="M", choices=["M", "MS"])
    ap.add_argument("--target", default="exhaust_temp")
    ap.add_argument("--seq_len", type=int, default=96)
    ap.add_argument("--label_len", type=int, default=48)
    ap.add_argument("--pred_len", type=int, default=24)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--n_heads", type=int, default=8)
    ap.add_argument("--e_layers", type=int, default=2)
    ap.add_argument("--d_layers", type=int, default=1)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--batch_size", type=int, default=32, help="global batch, split over ranks")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--num_workers", type=int, default=4)
    ap.add_argument("--ckpt_dir", default="./checkpoints/informer_turbine")
    return ap.parse_args()


def time_features(ts):
    ts = pd.to_datetime(ts)
    return np.stack([ts.month / 12 - 0.5, ts.day / 31 - 0.5, ts.dayofweek / 6 - 0.5,
                     ts.hour / 23 - 0.5, ts.minute / 59 - 0.5], axis=1).astype(np.float32)


class TurbineData(Dataset):
    def __init__(self, df, stamps, borders, split, seq_len, label_len, pred_len, mean, std):
        lo, hi = borders[split]
        self.x = ((df.values[lo:hi] - mean) / std).astype(np.float32)
        self.mark = time_features(stamps[lo:hi])
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self):
        return len(self.x) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s_end = i + self.seq_len
        r_begin = s_end - self.label_len
        r_end = s_end + self.pred_len
        return (self.x[i:s_end], self.x[r_begin:r_end],
                self.mark[i:s_end], self.mark[r_begin:r_end])


class DataEmbedding(nn.Module):
    def __init__(self, c_in, d_model, dropout, max_len=5000):
        super().__init__()
        self.value = nn.Conv1d(c_in, d_model, 3, padding=1, padding_mode="circular")
        self.temporal = nn.Linear(5, d_model)
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-np.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mark):
        v = self.value(x.transpose(1, 2)).transpose(1, 2)
        return self.drop(v + self.temporal(mark) + self.pe[:, : x.size(1)])


class DistilLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1, padding_mode="circular")
        self.norm = nn.LayerNorm(c)
        self.act = nn.ELU()
        self.pool = nn.MaxPool1d(3, stride=2, padding=1)

    def forward(self, x):
        x = self.act(self.norm(self.conv(x.transpose(1, 2)).transpose(1, 2)))
        return self.pool(x.transpose(1, 2)).transpose(1, 2)


class Informer(nn.Module):
    def __init__(self, enc_in, c_out, args):
        super().__init__()
        d = args.d_model
        self.pred_len = args.pred_len
        self.enc_emb = DataEmbedding(enc_in, d, args.dropout)
        self.dec_emb = DataEmbedding(enc_in, d, args.dropout)
        self.enc_layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, args.n_heads, 4 * d, args.dropout, batch_first=True)
            for _ in range(args.e_layers))
        self.distil = nn.ModuleList(DistilLayer(d) for _ in range(args.e_layers - 1))
        self.enc_norm = nn.LayerNorm(d)
        dec_layer = nn.TransformerDecoderLayer(d, args.n_heads, 4 * d, args.dropout, batch_first=True)
        self.decoder = nn.TransformerDecoder(dec_layer, args.d_layers, norm=nn.LayerNorm(d))
        self.proj = nn.Linear(d, c_out)

    def forward(self, x_enc, mark_enc, x_dec, mark_dec):
        h = self.enc_emb(x_enc, mark_enc)
        for i, layer in enumerate(self.enc_layers):
            h = layer(h)
            if i < len(self.distil):
                h = self.distil[i](h)
        mem = self.enc_norm(h)
        L = x_dec.size(1)
        causal = torch.triu(torch.full((L, L), float("-inf"), device=x_dec.device), 1)
        out = self.decoder(self.dec_emb(x_dec, mark_dec), mem, tgt_mask=causal)
        return self.proj(out)[:, -self.pred_len:]


def make_dec_input(batch_y, label_len, pred_len):
    zeros = torch.zeros_like(batch_y[:, -pred_len:])
    return torch.cat([batch_y[:, :label_len], zeros], dim=1)


def run_epoch_eval(model, loader, device, args, f_dim):
    model.eval()
    total, count = 0.0, 0
    crit = nn.MSELoss(reduction="sum")
    with torch.no_grad():
        for bx, by, mx, my in loader:
            bx, by = bx.to(device), by.to(device)
            mx, my = mx.to(device), my.to(device)
            dec_inp = make_dec_input(by, args.label_len, args.pred_len)
            out = model(bx, mx, dec_inp, my)[..., f_dim:]
            tgt = by[:, -args.pred_len:, f_dim:]
            total += crit(out, tgt).item()
            count += tgt.numel()
    t = torch.tensor([total, count], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(2021)

    df_raw = pd.read_csv(os.path.join(args.root, args.file))
    stamps = df_raw["date"].values
    cols = [c for c in df_raw.columns if c != "date"]
    cols.remove(args.target)
    df = df_raw[cols + [args.target]]
    n = len(df)
    n_train, n_test = int(n * 0.7), int(n * 0.2)
    n_val = n - n_train - n_test
    borders = {"train": (0, n_train),
               "val": (n_train - args.seq_len, n_train + n_val),
               "test": (n - n_test - args.seq_len, n)}
    train_vals = df.values[:n_train]
    mean, std = train_vals.mean(0), train_vals.std(0) + 1e-8

    kw = dict(seq_len=args.seq_len, label_len=args.label_len, pred_len=args.pred_len,
              mean=mean, std=std)
    train_set = TurbineData(df, stamps, borders, "train", **kw)
    val_set = TurbineData(df, stamps, borders, "val", **kw)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    per_rank_bs = max(1, args.batch_size // dist.get_world_size())
    train_loader = DataLoader(train_set, per_rank_bs, sampler=train_sampler,
                              num_workers=args.num_workers, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, per_rank_bs, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    enc_in = df.shape[1]
    c_out = enc_in if args.features == "M" else 1
    f_dim = 0 if args.features == "M" else -1
    model = Informer(enc_in, c_out, args).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    crit = nn.MSELoss()

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        log.info("enc_in=%d c_out=%d train=%d val=%d", enc_in, c_out, len(train_set), len(val_set))

    best, bad_epochs = float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        losses = []
        for it, (bx, by, mx, my) in enumerate(train_loader):
            bx, by = bx.to(device, non_blocking=True), by.to(device, non_blocking=True)
            mx, my = mx.to(device, non_blocking=True), my.to(device, non_blocking=True)
            dec_inp = make_dec_input(by, args.label_len, args.pred_len)
            out = model(bx, mx, dec_inp, my)[..., f_dim:]
            loss = crit(out, by[:, -args.pred_len:, f_dim:])
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
            if rank == 0 and (it + 1) % 200 == 0:
                log.info("epoch %d iter %d loss %.5f", epoch, it + 1, loss.item())

        val_mse = run_epoch_eval(model, val_loader, device, args, f_dim)
        log.info("epoch %d train %.5f val %.5f (%.0fs)", epoch, np.mean(losses), val_mse,
                 time.time() - t0)

        if val_mse < best:
            best, bad_epochs = val_mse, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "checkpoint.pth"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                log.info("early stopping at epoch %d", epoch)
                break

        # Informer's type1 lr adjustment: halve every epoch
        for g in optim.param_groups:
            g["lr"] = args.lr * (0.5 ** (epoch + 1))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
