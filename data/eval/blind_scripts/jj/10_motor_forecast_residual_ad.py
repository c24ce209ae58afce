"""Motor-current anomaly detection from forecast residuals.

A PatchTST forecaster is trained on normal operation; the anomaly score of a
window is the normalised error of its one-step-ahead forecasts. The threshold
is the value that maximises F1 on the labelled validation month.

    torchrun --standalone --nproc_per_node=4 10_motor_forecast_residual_ad.py --root /shared/motors
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def options():
    o = argparse.ArgumentParser()
    o.add_argument("--root", required=True)
    o.add_argument("--out", default="out/motor_residual")
    o.add_argument("--lookback", type=int, default=256)
    o.add_argument("--horizon", type=int, default=16)
    o.add_argument("--patch", type=int, default=16)
    o.add_argument("--d", type=int, default=128)
    o.add_argument("--layers", type=int, default=3)
    o.add_argument("--bs", type=int, default=256)
    o.add_argument("--epochs", type=int, default=12)
    o.add_argument("--lr", type=float, default=3e-4, help="single-GPU lr, scaled by world size")
    return o.parse_args()


class MotorWindows(Dataset):
    def __init__(self, x, labels, lookback, horizon, hop):
        self.x, self.labels = x, labels
        self.lb, self.h = lookback, horizon
        self.starts = np.arange(0, len(x) - lookback - horizon + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        x = self.x[s:s + self.lb]
        y = self.x[s + self.lb:s + self.lb + self.h]
        lab = 0 if self.labels is None else int(self.labels[s + self.lb:s + self.lb + self.h].max())
        return torch.from_numpy(x), torch.from_numpy(y), lab


class Forecaster(nn.Module):
    def __init__(self, n_ch, a):
        super().__init__()
        self.patch, self.h, self.n_ch = a.patch, a.horizon, n_ch
        n_tok = a.lookback // a.patch
        self.embed = nn.Linear(a.patch, a.d)
        self.pos = nn.Parameter(torch.zeros(1, n_tok, a.d))
        layer = nn.TransformerEncoderLayer(a.d, 8, 4 * a.d, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, a.layers, norm=nn.LayerNorm(a.d))
        self.head = nn.Linear(n_tok * a.d, a.horizon)

    def forward(self, x):  # (B, L, C) -> (B, H, C)
        B, L, C = x.shape
        mu = x.mean(1, keepdim=True)
        sd = x.std(1, keepdim=True) + 1e-4
        z = ((x - mu) / sd).transpose(1, 2).reshape(B * C, L)
        tok = self.embed(z.view(B * C, L // self.patch, self.patch)) + self.pos
        y = self.head(self.enc(tok).flatten(1)).view(B, C, self.h).transpose(1, 2)
        return y * sd + mu


def read_split(root, name):
    df = pd.read_parquet(os.path.join(root, f"{name}.parquet"))
    labels = df.pop("anomaly").to_numpy(np.int8) if "anomaly" in df else None
    return df.to_numpy(np.float32), labels


@torch.no_grad()
def scores_on(model, ds, device, rank, world):
    # contiguous block per rank keeps the windows of a rank in time order
    per = (len(ds) + world - 1) // world
    part = Subset(ds, range(rank * per, min(len(ds), (rank + 1) * per)))
    dl = DataLoader(part, batch_size=512, num_workers=4, pin_memory=True)
    model.eval()
    s_list, l_list = [], []
    for x, y, lab in dl:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        err = (model(x) - y).pow(2).mean(dim=(1, 2))
        s_list.append(err)
        l_list.append(lab.to(device))
    model.train()
    local = torch.stack([torch.cat(s_list), torch.cat(l_list).float()], dim=1)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    allv = torch.cat(gathered).cpu().numpy()
    return allv[:, 0], allv[:, 1].astype(int)


def f1_at(scores, labels, t):
    pred = scores > t
    tp = np.sum(pred & (labels == 1))
    fp = np.sum(pred & (labels == 0))
    fn = np.sum(~pred & (labels == 1))
    return 2 * tp / max(1, 2 * tp + fp + fn)


def main():
    a = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tr_x, _ = read_split(a.root, "train_normal")
    va_x, va_y = read_split(a.root, "val_labelled")
    te_x, te_y = read_split(a.root, "test_labelled")
    mu, sd = tr_x.mean(0), tr_x.std(0) + 1e-6  # per-sensor, normal data only
    tr_x, va_x, te_x = [((v - mu) / sd).astype(np.float32) for v in (tr_x, va_x, te_x)]

    train_ds = MotorWindows(tr_x, None, a.lookback, a.horizon, hop=4)
    val_ds = MotorWindows(va_x, va_y, a.lookback, a.horizon, hop=a.horizon)
    test_ds = MotorWindows(te_x, te_y, a.lookback, a.horizon, hop=a.horizon)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.bs, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)

    model = DDP(Forecaster(tr_x.shape[1], a).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * len(train_dl))

    for ep in range(a.epochs):
        sampler.set_epoch(ep)
        acc = torch.zeros(2, device=dev)
        for x, y, _ in train_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc[0] += loss.detach()
            acc[1] += 1
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {ep} mse {(acc[0] / acc[1]).item():.5f}", flush=True)

    val_s, val_l = scores_on(model, val_ds, dev, rank, world)
    cands = np.unique(np.quantile(val_s, np.linspace(0.5, 0.999, 300)))
    f1s = [f1_at(val_s, val_l, t) for t in cands]
    thr = float(cands[int(np.argmax(f1s))])
    test_s, test_l = scores_on(model, test_ds, dev, rank, world)

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"val best F1 {max(f1s):.3f} at thr {thr:.5f}; test F1 {f1_at(test_s, test_l, thr):.3f}")
        torch.save({"model": model.module.state_dict(), "threshold": thr,
                    "mu": torch.from_numpy(mu), "sd": torch.from_numpy(sd)},
                   os.path.join(a.out, "motor_ad.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
