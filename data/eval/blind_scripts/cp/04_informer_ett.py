"""Informer-style encoder/decoder on ETTh1/ETTm1 (multivariate -> multivariate).

    torchrun --nproc_per_node=4 04_informer_ett.py --data ETTh1 --pred_len 336
"""
import argparse
import json
import os
from datetime import datetime

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# standard ETT borders (12/4/4 months)
BORDERS = {"ETTh1": (12 * 30 * 24, 4 * 30 * 24), "ETTm1": (12 * 30 * 96, 4 * 30 * 96)}


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="./dataset/ETT-small")
    p.add_argument("--data", default="ETTh1", choices=list(BORDERS))
    p.add_argument("--seq_len", type=int, default=96)
    p.add_argument("--label_len", type=int, default=48)
    p.add_argument("--pred_len", type=int, default=96)
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--n_heads", type=int, default=8)
    p.add_argument("--e_layers", type=int, default=2)
    p.add_argument("--d_layers", type=int, default=1)
    p.add_argument("--d_ff", type=int, default=2048)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--train_epochs", type=int, default=10)
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--checkpoints", default="./checkpoints")
    return p


def time_features(dates):
    d = pd.DatetimeIndex(dates)
    return np.stack([d.month / 12 - 0.5, d.day / 31 - 0.5, d.dayofweek / 6 - 0.5,
                     d.hour / 23 - 0.5, d.minute / 59 - 0.5], axis=1).astype(np.float32)


class ETTDataset(Dataset):
    def __init__(self, root, name, flag, seq_len, label_len, pred_len):
        df = pd.read_csv(os.path.join(root, f"{name}.csv"))
        n_train, n_val = BORDERS[name]
        b1 = {"train": 0, "val": n_train - seq_len, "test": n_train + n_val - seq_len}[flag]
        b2 = {"train": n_train, "val": n_train + n_val, "test": n_train + 2 * n_val}[flag]
        data = df[df.columns[1:]].to_numpy(np.float32)
        train = data[:n_train]
        self.mean, self.std = train.mean(0), train.std(0) + 1e-8
        data = (data - self.mean) / self.std
        self.x = data[b1:b2]
        self.stamp = time_features(df["date"].values[b1:b2])
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self):
        return len(self.x) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        s_end = i + self.seq_len
        r_begin = s_end - self.label_len
        r_end = s_end + self.pred_len
        return (self.x[i:s_end], self.x[r_begin:r_end],
                self.stamp[i:s_end], self.stamp[r_begin:r_end])


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
        return self.drop(v + self.temporal(mark) + self.pe[:, :x.size(1)])


class DistilLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1, padding_mode="circular")
        self.norm = nn.BatchNorm1d(d)
        self.pool = nn.MaxPool1d(3, stride=2, padding=1)

    def forward(self, x):
        x = self.pool(F.elu(self.norm(self.conv(x.transpose(1, 2)))))
        return x.transpose(1, 2)


class Informer(nn.Module):
    def __init__(self, c, a):
        super().__init__()
        self.pred_len = a.pred_len
        self.enc_emb = DataEmbedding(c, a.d_model, a.dropout)
        self.dec_emb = DataEmbedding(c, a.d_model, a.dropout)
        self.enc_layers = nn.ModuleList([
            nn.TransformerEncoderLayer(a.d_model, a.n_heads, a.d_ff, a.dropout, "gelu", batch_first=True)
            for _ in range(a.e_layers)])
        self.distil = nn.ModuleList([DistilLayer(a.d_model) for _ in range(a.e_layers - 1)])
        self.enc_norm = nn.LayerNorm(a.d_model)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(a.d_model, a.n_heads, a.d_ff, a.dropout, "gelu", batch_first=True),
            a.d_layers, norm=nn.LayerNorm(a.d_model))
        self.proj = nn.Linear(a.d_model, c)

    def forward(self, x_enc, mark_enc, x_dec, mark_dec):
        h = self.enc_emb(x_enc, mark_enc)
        for i, layer in enumerate(self.enc_layers):
            h = layer(h)
            if i < len(self.distil):
                h = self.distil[i](h)
        mem = self.enc_norm(h)
        d = self.dec_emb(x_dec, mark_dec)
        T = d.size(1)
        causal = torch.triu(torch.full((T, T), float("-inf"), device=d.device), 1)
        out = self.decoder(d, mem, tgt_mask=causal)
        return self.proj(out)[:, -self.pred_len:]


def decoder_input(batch_y, label_len, pred_len):
    zeros = torch.zeros_like(batch_y[:, -pred_len:])
    return torch.cat([batch_y[:, :label_len], zeros], dim=1)


def run_batch(model, batch, args, device):
    bx, by, mx, my = (t.to(device, non_blocking=True).float() for t in batch)
    out = model(bx, mx, decoder_input(by, args.label_len, args.pred_len), my)
    return out, by[:, -args.pred_len:]


@torch.no_grad()
def validate(model, loader, args, device):
    model.eval()
    total = torch.zeros(2, device=device)
    for batch in loader:
        out, y = run_batch(model, batch, args, device)
        total[0] += F.mse_loss(out, y, reduction="sum")
        total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    args = get_parser().parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2021)

    sets = {f: ETTDataset(args.root, args.data, f, args.seq_len, args.label_len, args.pred_len)
            for f in ("train", "val", "test")}
    samplers = {f: DistributedSampler(ds, shuffle=(f == "train"), drop_last=(f != "test"))
                for f, ds in sets.items()}
    # --batch_size is the global batch (paper setting), split over the ranks
    per_rank = max(1, args.batch_size // world)
    loaders = {f: DataLoader(ds, batch_size=per_rank, sampler=samplers[f],
                             num_workers=4, pin_memory=True, drop_last=(f == "train"))
               for f, ds in sets.items()}
    c = sets["train"].x.shape[1]

    model = Informer(c, args).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    setting = f"informer_{args.data}_sl{args.seq_len}_ll{args.label_len}_pl{args.pred_len}"
    ckpt_dir = os.path.join(args.checkpoints, setting)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    best, bad = float("inf"), 0

    for epoch in range(args.train_epochs):
        samplers["train"].set_epoch(epoch)
        model.train()
        losses = []
        for batch in loaders["train"]:
            opt.zero_grad()
            out, y = run_batch(model, batch, args, device)
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        val = validate(model, loaders["val"], args, device)
        if rank == 0:
            print(f"{datetime.now():%H:%M:%S} epoch {epoch + 1} train {np.mean(losses):.5f} val {val:.5f}")
        if val < best:
            best, bad = val, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "checkpoint.pth"))
        else:
            bad += 1
            if bad >= args.patience:
                if rank == 0:
                    print("early stopping")
                break
        # type1 lr schedule from the Informer repo
        for g in opt.param_groups:
            g["lr"] = args.lr * (0.5 ** epoch)

    dist.barrier()
    state = torch.load(os.path.join(ckpt_dir, "checkpoint.pth"), map_location=device)
    model.module.load_state_dict(state)
    model.eval()
    preds, trues = [], []
    with torch.no_grad():
        for batch in loaders["test"]:
            out, y = run_batch(model, batch, args, device)
            preds.append(out.cpu().numpy())
            trues.append(y.cpu().numpy())
    preds, trues = np.concatenate(preds), np.concatenate(trues)
    mse = float(np.mean((preds - trues) ** 2))
    mae = float(np.mean(np.abs(preds - trues)))
    if rank == 0:
        print(f"test mse {mse:.4f} mae {mae:.4f}")
        with open(os.path.join(ckpt_dir, "result.json"), "w") as f:
            json.dump({"setting": setting, "mse": mse, "mae": mae}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
