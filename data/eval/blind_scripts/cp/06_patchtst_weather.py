"""PatchTST/42 supervised on Weather (21 channels), multi-GPU.

    torchrun --nproc_per_node=4 06_patchtst_weather.py --pred_len 192 --compile
"""
import argparse
import json
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


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="data/weather/weather.csv")
    p.add_argument("--out", default="results/patchtst_weather")
    p.add_argument("--seq_len", type=int, default=336)
    p.add_argument("--pred_len", type=int, default=96)
    p.add_argument("--patch_len", type=int, default=16)
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--e_layers", type=int, default=3)
    p.add_argument("--d_ff", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--global_batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--patience", type=int, default=20)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class CustomSplit(Dataset):
    """7:1:2 chronological split, scaler fitted on the training part only."""

    def __init__(self, csv, flag, seq_len, pred_len):
        df = pd.read_csv(csv)
        v = df[df.columns[1:]].to_numpy(np.float32)
        n = len(v)
        n_tr, n_te = int(n * 0.7), int(n * 0.2)
        n_va = n - n_tr - n_te
        lo = {"train": 0, "val": n_tr - seq_len, "test": n - n_te - seq_len}[flag]
        hi = {"train": n_tr, "val": n_tr + n_va, "test": n}[flag]
        mu, sd = v[:n_tr].mean(0), v[:n_tr].std(0) + 1e-8
        self.v = ((v - mu) / sd)[lo:hi]
        self.L, self.H = seq_len, pred_len
        self.channels = v.shape[1]

    def __len__(self):
        return len(self.v) - self.L - self.H + 1

    def __getitem__(self, i):
        return self.v[i:i + self.L], self.v[i + self.L:i + self.L + self.H]


class TSTLayer(nn.Module):
    """Post-norm encoder layer with BatchNorm over the patch dimension (as in PatchTST)."""

    def __init__(self, d, h, d_ff, drop):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, h, dropout=drop, batch_first=True)
        self.bn1 = nn.BatchNorm1d(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Dropout(drop), nn.Linear(d_ff, d))
        self.bn2 = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(drop)

    def _bn(self, bn, x):
        return bn(x.transpose(1, 2)).transpose(1, 2)

    def forward(self, x):
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self._bn(self.bn1, x + self.drop(a))
        return self._bn(self.bn2, x + self.drop(self.ff(x)))


class PatchTST(nn.Module):
    def __init__(self, c, a):
        super().__init__()
        self.c, self.P, self.S = c, a.patch_len, a.stride
        n = (a.seq_len - a.patch_len) // a.stride + 2
        self.emb = nn.Linear(a.patch_len, a.d_model)
        self.pos = nn.Parameter(torch.empty(1, n, a.d_model).uniform_(-0.02, 0.02))
        self.layers = nn.ModuleList([TSTLayer(a.d_model, a.n_heads, a.d_ff, a.dropout)
                                     for _ in range(a.e_layers)])
        self.drop = nn.Dropout(a.dropout)
        self.head = nn.Linear(n * a.d_model, a.pred_len)

    def forward(self, x):  # (B, L, C)
        B, L, C = x.shape
        mu = x.mean(1, keepdim=True).detach()
        sd = (x.var(1, keepdim=True, unbiased=False) + 1e-5).sqrt().detach()
        x = ((x - mu) / sd).permute(0, 2, 1).reshape(B * C, 1, L)
        x = F.pad(x, (0, self.S), mode="replicate").squeeze(1)
        z = self.drop(self.emb(x.unfold(-1, self.P, self.S)) + self.pos)
        for layer in self.layers:
            z = layer(z)
        y = self.head(z.flatten(1)).reshape(B, C, -1).permute(0, 2, 1)
        return y * sd + mu


@torch.no_grad()
def evaluate(model, loader, device, channels):
    """Per-channel sums are reduced over ranks; padded duplicates are masked out."""
    model.eval()
    sse = torch.zeros(channels, device=device, dtype=torch.float64)
    sae = torch.zeros_like(sse)
    cnt = torch.zeros((), device=device, dtype=torch.float64)
    sampler = loader.sampler
    n_real = len(sampler.dataset)
    seen = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = model(x)
        p = p.float()
        # global position of each sample under DistributedSampler(shuffle=False)
        pos = sampler.rank + sampler.num_replicas * torch.arange(seen, seen + len(x), device=device)
        keep = (pos < n_real).double().view(-1, 1, 1)
        seen += len(x)
        sse += (keep * (p - y).double() ** 2).sum((0, 1))
        sae += (keep * (p - y).double().abs()).sum((0, 1))
        cnt += keep.sum() * y.shape[1]
    dist.all_reduce(sse)
    dist.all_reduce(sae)
    dist.all_reduce(cnt)
    model.train()
    mse_c, mae_c = (sse / cnt).cpu().numpy(), (sae / cnt).cpu().numpy()
    return float(mse_c.mean()), float(mae_c.mean()), mse_c.tolist()


def main():
    a = args_()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.manual_seed(2021)

    tr, va, te = (CustomSplit(a.csv, f, a.seq_len, a.pred_len) for f in ("train", "val", "test"))
    bs = a.global_batch // world
    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, bs, sampler=tr_s, num_workers=8, pin_memory=True, drop_last=True)
    va_dl = DataLoader(va, 256, sampler=DistributedSampler(va, shuffle=False), num_workers=4)
    te_dl = DataLoader(te, 256, sampler=DistributedSampler(te, shuffle=False), num_workers=4)

    net = PatchTST(tr.channels, a)
    # per-GPU batch is small and BatchNorm sees B*C*patches rows; sync stats anyway
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(dev)
    ddp = DDP(net, device_ids=[local])
    model = torch.compile(ddp) if a.compile else ddp

    opt = torch.optim.Adam(net.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, epochs=a.epochs,
                                                steps_per_epoch=len(tr_dl), pct_start=0.3)
    os.makedirs(a.out, exist_ok=True)
    ck_path = os.path.join(a.out, "ckpt.pt")
    start, best, bad = 0, math.inf, 0
    if a.resume and os.path.isfile(ck_path):
        ck = torch.load(ck_path, map_location={"cuda:0": f"cuda:{local}"})
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best, bad = ck["epoch"] + 1, ck["best"], ck["bad"]

    for ep in range(start, a.epochs):
        tr_s.set_epoch(ep)
        t0, tot = time.time(), 0.0
        for x, y in tr_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.mse_loss(model(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item()
        v_mse, v_mae, _ = evaluate(model, va_dl, dev, tr.channels)
        improved = v_mse < best
        best, bad = (v_mse, 0) if improved else (best, bad + 1)
        if rank == 0:
            print(f"ep {ep:3d} loss {tot / len(tr_dl):.4f} val mse {v_mse:.4f} mae {v_mae:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": ep, "best": best, "bad": bad}
            torch.save(ck, ck_path + ".tmp")
            os.replace(ck_path + ".tmp", ck_path)
            if improved:
                torch.save(net.state_dict(), os.path.join(a.out, "best.pt"))
        dist.barrier()
        if bad >= a.patience:
            break

    net.load_state_dict(torch.load(os.path.join(a.out, "best.pt"), map_location=dev))
    mse, mae, per_ch = evaluate(model, te_dl, dev, tr.channels)
    if rank == 0:
        print(f"test mse {mse:.4f} mae {mae:.4f}")
        json.dump({"mse": mse, "mae": mae, "per_channel_mse": per_ch},
                  open(os.path.join(a.out, f"test_{a.pred_len}.json"), "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
