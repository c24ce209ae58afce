"""Cement kiln process forecasting (burning-zone temp, kiln torque, O2/CO/NOx at
the inlet, main-drive current) with an Informer-like encoder/decoder and a
start-token decoder input. Resumable: the latest state is kept in
<ckpt_dir>/latest.pt and the best model in <ckpt_dir>/best.pt.

    torchrun --standalone --nproc_per_node=8 20_cement_kiln_informer_resume.py \
        --data /mnt/shared/kiln3/kiln3_1min.feather --ckpt-dir /mnt/shared/kiln3/ckpt
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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--seq-len", type=int, default=240)
    p.add_argument("--label-len", type=int, default=60)
    p.add_argument("--pred-len", type=int, default=60)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--enc-layers", type=int, default=3)
    p.add_argument("--dec-layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=1000)
    return p.parse_args()


class KilnWindows(Dataset):
    def __init__(self, arr, seq_len, label_len, pred_len):
        self.arr = arr
        self.seq_len, self.label_len, self.pred_len = seq_len, label_len, pred_len

    def __len__(self):
        return len(self.arr) - self.seq_len - self.pred_len + 1

    def __getitem__(self, i):
        e = i + self.seq_len
        enc = self.arr[i:e]
        dec = self.arr[e - self.label_len:e + self.pred_len]
        return torch.from_numpy(enc), torch.from_numpy(dec)


class Embed(nn.Module):
    def __init__(self, c_in, d, max_len=4096):
        super().__init__()
        self.tok = nn.Conv1d(c_in, d, 3, padding=1, padding_mode="circular")
        self.pos = nn.Embedding(max_len, d)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device)
        return self.tok(x.transpose(1, 2)).transpose(1, 2) + self.pos(pos)


class KilnInformer(nn.Module):
    def __init__(self, c_in, a):
        super().__init__()
        self.label_len, self.pred_len = a.label_len, a.pred_len
        self.enc_embed = Embed(c_in, a.d_model)
        self.dec_embed = Embed(c_in, a.d_model)
        enc_layer = nn.TransformerEncoderLayer(a.d_model, a.heads, 4 * a.d_model, 0.05,
                                               batch_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, a.enc_layers, norm=nn.LayerNorm(a.d_model))
        dec_layer = nn.TransformerDecoderLayer(a.d_model, a.heads, 4 * a.d_model, 0.05,
                                               batch_first=True)
        self.decoder = nn.TransformerDecoder(dec_layer, a.dec_layers, norm=nn.LayerNorm(a.d_model))
        self.proj = nn.Linear(a.d_model, c_in)

    def forward(self, enc_x, dec_x):
        dec_in = torch.cat([dec_x[:, :self.label_len], torch.zeros_like(dec_x[:, self.label_len:])], 1)
        mem = self.encoder(self.enc_embed(enc_x))
        L = dec_in.shape[1]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool, device=enc_x.device), 1)
        out = self.decoder(self.dec_embed(dec_in), mem, tgt_mask=mask)
        return self.proj(out)[:, -self.pred_len:]


def save_checkpoint(path, model, opt, sched, epoch, best, stats):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "epoch": epoch, "best": best,
                "mean": stats[0], "std": stats[1]}, path)


@torch.no_grad()
def validate(model, loader, device, pred_len):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for enc, dec in loader:
        enc, dec = enc.to(device), dec.to(device)
        y = dec[:, -pred_len:]
        p = model(enc, dec)
        s[0] += (p - y).pow(2).sum()
        s[1] += (p - y).abs().sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(77)

    df = pd.read_feather(a.data).set_index("time")
    arr = df.to_numpy(np.float32)
    n = len(arr)
    n_tr, n_va = int(0.7 * n), int(0.15 * n)
    mean = torch.from_numpy(arr[:n_tr].mean(0))
    std = torch.from_numpy(arr[:n_tr].std(0) + 1e-6)
    arr = ((arr - mean.numpy()) / std.numpy()).astype(np.float32)
    train_ds = KilnWindows(arr[:n_tr], a.seq_len, a.label_len, a.pred_len)
    val_ds = KilnWindows(arr[n_tr - a.seq_len:n_tr + n_va], a.seq_len, a.label_len, a.pred_len)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=128, sampler=val_sampler, num_workers=4, pin_memory=True)

    model = DDP(KilnInformer(arr.shape[1], a).to(device), device_ids=[local_rank])
    peak = a.lr * math.sqrt(world * a.batch / 32)
    opt = torch.optim.Adam(model.parameters(), lr=peak)
    total = a.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / a.warmup_steps, 0.5 * (1 + math.cos(math.pi * s / total))))

    os.makedirs(a.ckpt_dir, exist_ok=True)
    latest = os.path.join(a.ckpt_dir, "latest.pt")
    start_epoch, best = 0, float("inf")
    if os.path.exists(latest):
        ck = torch.load(latest, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resuming at epoch {start_epoch} (best val mse {best:.4f})")

    for epoch in range(start_epoch, a.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for enc, dec in train_dl:
            enc, dec = enc.to(device, non_blocking=True), dec.to(device, non_blocking=True)
            loss = F.mse_loss(model(enc, dec), dec[:, -a.pred_len:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            agg[0] += loss.detach()
            agg[1] += 1
        dist.all_reduce(agg)

        val_mse, val_mae = validate(model, val_dl, device, a.pred_len)
        if rank == 0:
            print(f"epoch {epoch:02d} train {(agg[0] / agg[1]).item():.4f} val mse {val_mse:.4f} "
                  f"mae {val_mae:.4f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)",
                  flush=True)
        if val_mse < best:
            best = val_mse
            save_checkpoint(os.path.join(a.ckpt_dir, "best.pt"), model, opt, sched, epoch, best,
                            (mean, std))
        save_checkpoint(latest, model, opt, sched, epoch, best, (mean, std))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
