"""PatchTST on ETTm2 with a final export step for the serving job.

Trains with DDP, keeps the best-validation weights, then reloads them into a
plain (unwrapped) model for the test-set evaluation and TorchScript export.

    torchrun --nproc_per_node=4 18_patchtst_ettm2_export.py --cfg configs/ettm2_336_192.json
"""
import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Cfg:
    csv: str = "dataset/ETT-small/ETTm2.csv"
    out: str = "exports/patchtst_ettm2"
    seq_len: int = 336
    pred_len: int = 192
    patch: int = 16
    stride: int = 8
    d_model: int = 128
    heads: int = 16
    layers: int = 3
    d_ff: int = 256
    dropout: float = 0.2
    head_dropout: float = 0.0
    batch: int = 64
    lr: float = 1e-4
    epochs: int = 30
    patience: int = 5


class ETTm(Dataset):
    def __init__(self, csv, split, L, H):
        df = pd.read_csv(csv)
        v = df.iloc[:, 1:].to_numpy(np.float32)
        n_tr, n_va, n_te = 12 * 30 * 96, 4 * 30 * 96, 4 * 30 * 96
        b = {"train": (0, n_tr), "val": (n_tr - L, n_tr + n_va), "test": (n_tr + n_va - L, n_tr + n_va + n_te)}
        lo, hi = b[split]
        mu, sd = v[:n_tr].mean(0), v[:n_tr].std(0) + 1e-8
        self.v = ((v - mu) / sd)[lo:hi]
        self.L, self.H = L, H

    def __len__(self):
        return len(self.v) - self.L - self.H + 1

    def __getitem__(self, i):
        return self.v[i:i + self.L], self.v[i + self.L:i + self.L + self.H]


class PatchTST(nn.Module):
    def __init__(self, c: Cfg, n_vars: int):
        super().__init__()
        self.patch, self.stride = c.patch, c.stride
        n = (c.seq_len - c.patch) // c.stride + 2
        self.W_P = nn.Linear(c.patch, c.d_model)
        self.W_pos = nn.Parameter(torch.empty(n, c.d_model).uniform_(-0.02, 0.02))
        layer = nn.TransformerEncoderLayer(c.d_model, c.heads, c.d_ff, c.dropout, "gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, c.layers)
        self.dropout = nn.Dropout(c.dropout)
        self.head = nn.Sequential(nn.Flatten(-2), nn.Dropout(c.head_dropout), nn.Linear(n * c.d_model, c.pred_len))
        self.affine_w = nn.Parameter(torch.ones(n_vars))
        self.affine_b = nn.Parameter(torch.zeros(n_vars))

    def forward(self, x):  # (B, L, C)
        B, L, C = x.shape
        mu = x.mean(1, keepdim=True).detach()
        sd = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5).detach()
        x = (x - mu) / sd * self.affine_w + self.affine_b
        x = x.permute(0, 2, 1)                                          # (B, C, L)
        x = torch.cat([x, x[..., -1:].expand(-1, -1, self.stride)], -1)
        p = x.unfold(-1, self.patch, self.stride)                       # (B, C, N, P)
        z = self.dropout(self.W_P(p) + self.W_pos).reshape(B * C, p.shape[2], -1)
        z = self.encoder(z).reshape(B, C, p.shape[2], -1)
        y = self.head(z).permute(0, 2, 1)                               # (B, H, C)
        y = (y - self.affine_b) / (self.affine_w + 1e-10)
        return y * sd + mu


@torch.no_grad()
def evaluate(model, loader, dev):
    model.eval()
    s = torch.zeros(3, device=dev, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(dev), y.to(dev)
        p = model(x)
        s += torch.stack([((p - y) ** 2).sum().double(), (p - y).abs().sum().double(),
                          torch.tensor(float(y.numel()), device=dev, dtype=torch.float64)])
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = Cfg()
    path = ap.parse_args().cfg
    if path:
        cfg = Cfg(**{**asdict(cfg), **json.load(open(path))})

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(2021)

    tr = ETTm(cfg.csv, "train", cfg.seq_len, cfg.pred_len)
    va = ETTm(cfg.csv, "val", cfg.seq_len, cfg.pred_len)
    te = ETTm(cfg.csv, "test", cfg.seq_len, cfg.pred_len)
    n_vars = tr.v.shape[1]
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, cfg.batch, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    va_dl = DataLoader(Subset(va, range(rank, len(va), world)), 256, num_workers=4)
    te_dl = DataLoader(Subset(te, range(rank, len(te), world)), 256, num_workers=4)

    model = DDP(PatchTST(cfg, n_vars).to(dev), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, epochs=cfg.epochs, steps_per_epoch=len(tr_dl),
                                                pct_start=0.3)
    best_path = os.path.join(cfg.out, "best.pt")
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        json.dump(asdict(cfg), open(os.path.join(cfg.out, "config.json"), "w"), indent=2)

    best, bad = float("inf"), 0
    for ep in range(cfg.epochs):
        sampler.set_epoch(ep)
        model.train()
        t0, tot = time.time(), 0.0
        for x, y in tr_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += loss.item()
        vmse, vmae = evaluate(model, va_dl, dev)
        if rank == 0:
            print(f"epoch {ep + 1} | train {tot / len(tr_dl):.4f} | val mse {vmse:.4f} mae {vmae:.4f} "
                  f"| {time.time() - t0:.0f}s", flush=True)
        if vmse < best:
            best, bad = vmse, 0
            if rank == 0:
                torch.save(model.state_dict(), best_path)
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    dist.barrier()

    # reload best weights into an unwrapped model for test + export
    final = PatchTST(cfg, n_vars).to(dev)
    final.load_state_dict(torch.load(best_path, map_location=dev))
    mse, mae = evaluate(final, te_dl, dev)
    if rank == 0:
        print(f"test mse {mse:.4f} mae {mae:.4f}")
        with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
            json.dump({"test_mse": mse, "test_mae": mae, "best_val_mse": best}, f, indent=2)
        example = torch.randn(1, cfg.seq_len, n_vars, device=dev)
        torch.jit.trace(final.eval(), example).save(os.path.join(cfg.out, "patchtst_ettm2.ts"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
