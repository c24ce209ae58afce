"""Plasma-etch chamber trace forecasting (RF power, chamber pressure, gas flows,
endpoint OES channels). Wafers are concatenated per chamber; windows are cut per
chamber and normalised with per-sensor statistics of the training wafers.

torchrun --standalone --nproc_per_node=4 13_etch_chamber_gpu_norm.py --data /data/fab/etch/chamberA.pt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="torch file with 'train', 'val' (T, C) float tensors")
    ap.add_argument("--save", default="ckpt/etch_chamberA")
    ap.add_argument("--ctx", type=int, default=400)
    ap.add_argument("--pred", type=int, default=50)
    ap.add_argument("--patch", type=int, default=20)
    ap.add_argument("--width", type=int, default=160)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


class ChamberWindows(Dataset):
    def __init__(self, series, mean, std, ctx, pred, hop, device):
        self.series = series  # (T, C) cpu float tensor
        self.mean = mean.to(device)
        self.std = std.to(device)
        self.ctx, self.pred = ctx, pred
        self.starts = torch.arange(0, series.shape[0] - ctx - pred + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        w = self.series[s:s + self.ctx + self.pred].to(self.mean.device, non_blocking=True)
        w = (w - self.mean) / self.std
        return w[: self.ctx], w[self.ctx:]


class PatchMixer(nn.Module):
    def __init__(self, n_ch, a):
        super().__init__()
        self.patch, self.pred, self.n_ch = a.patch, a.pred, n_ch
        n_tok = a.ctx // a.patch
        self.tok = nn.Linear(a.patch, a.width)
        self.pos = nn.Parameter(torch.zeros(1, n_tok, a.width))
        self.ch_emb = nn.Embedding(n_ch, a.width)
        layer = nn.TransformerEncoderLayer(a.width, 8, 4 * a.width, 0.1, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, a.depth, norm=nn.LayerNorm(a.width))
        self.head = nn.Linear(n_tok * a.width, a.pred)

    def forward(self, x):  # (B, L, C)
        B, L, C = x.shape
        mu = x.mean(1, keepdim=True)
        sd = x.std(1, keepdim=True) + 1e-5
        z = ((x - mu) / sd).transpose(1, 2).reshape(B * C, L // self.patch, self.patch)
        ch = self.ch_emb(torch.arange(C, device=x.device)).repeat(B, 1).unsqueeze(1)
        h = self.enc(self.tok(z) + self.pos + ch)
        y = self.head(h.flatten(1)).view(B, C, self.pred).transpose(1, 2)
        return y * sd + mu


@torch.no_grad()
def val_metrics(model, loader, device, pred_len):
    model.eval()
    buckets = [h for h in (5, 10, 25, 50) if h <= pred_len]
    acc = torch.zeros(len(buckets) + 2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        err = (model(x) - y).abs()
        for k, h in enumerate(buckets):
            acc[k] += err[:, :h].mean(dim=(1, 2)).sum()
        acc[-2] += err.pow(2).mean(dim=(1, 2)).sum()
        acc[-1] += x.shape[0]
    dist.all_reduce(acc)
    model.train()
    out = {f"mae@{h}": (acc[k] / acc[-1]).item() for k, h in enumerate(buckets)}
    out["mse"] = (acc[-2] / acc[-1]).item()
    return out


def main():
    a = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(99)

    blob = torch.load(a.data, map_location="cpu")
    train, val = blob["train"].float(), blob["val"].float()
    mean, std = train.mean(0), train.std(0).clamp_min(1e-6)
    train_ds = ChamberWindows(train, mean, std, a.ctx, a.pred, hop=5, device=device)
    val_ds = ChamberWindows(val, mean, std, a.ctx, a.pred, hop=a.pred, device=device)

    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=tr_sampler, num_workers=a.workers,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=2 * a.batch, sampler=va_sampler, num_workers=a.workers)

    model = DDP(PatchMixer(train.shape[1], a).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr * math.sqrt(world), weight_decay=0.02)
    total = a.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 200) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(a.save, exist_ok=True)
        print(f"channels={train.shape[1]} train_windows={len(train_ds)} val_windows={len(val_ds)}")

    best = float("inf")
    for epoch in range(a.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (x, y) in enumerate(train_dl):
            loss = F.l1_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"  ep {epoch} step {step}/{len(train_dl)} l1 {loss.item():.4f}", flush=True)

        m = val_metrics(model, val_dl, device, a.pred)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in m.items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            if m["mse"] < best:
                best = m["mse"]
                torch.save({"model": model.module.state_dict(), "mean": mean, "std": std,
                            "epoch": epoch, "metrics": m}, os.path.join(a.save, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
