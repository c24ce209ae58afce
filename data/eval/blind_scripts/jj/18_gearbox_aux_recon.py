"""Wind-turbine gearbox SCADA forecasting (bearing temps, oil temp/pressure,
rotor speed, power) with an auxiliary masked-patch reconstruction loss that
regularises the encoder. The auxiliary loss is applied every few steps.

    torchrun --standalone --nproc_per_node=4 18_gearbox_aux_recon.py --farm-dir /shared/scada/farm_b
"""
import argparse
import glob
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SIGNALS = ["gen_bearing_de", "gen_bearing_nde", "gbx_oil_temp", "gbx_oil_press",
           "gbx_bearing_hs", "gbx_bearing_ims", "rotor_rpm", "active_power"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--farm-dir", required=True)
    p.add_argument("--out", default="runs/gearbox_aux")
    p.add_argument("--lookback", type=int, default=432)  # 3 days @10 min
    p.add_argument("--horizon", type=int, default=144)
    p.add_argument("--patch", type=int, default=24)
    p.add_argument("--stride", type=int, default=12)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--aux-every", type=int, default=4)
    p.add_argument("--aux-weight", type=float, default=0.3)
    p.add_argument("--mask-ratio", type=float, default=0.4)
    return p.parse_args()


class TurbineWindows(Dataset):
    def __init__(self, arr, lookback, horizon, hop):
        self.arr, self.lb, self.h = arr, lookback, horizon
        self.starts = np.arange(0, len(arr) - lookback - horizon + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return (torch.from_numpy(self.arr[s:s + self.lb]),
                torch.from_numpy(self.arr[s + self.lb:s + self.lb + self.h]))


class AuxPatchTST(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.patch, self.stride, self.h = a.patch, a.stride, a.horizon
        n = (a.lookback - a.patch) // a.stride + 1
        self.embed = nn.Linear(a.patch, a.d_model)
        self.mask_token = nn.Parameter(torch.zeros(a.d_model))
        self.pos = nn.Parameter(torch.zeros(1, n, a.d_model))
        layer = nn.TransformerEncoderLayer(a.d_model, 8, 4 * a.d_model, 0.2, batch_first=True,
                                           norm_first=True)
        self.enc = nn.TransformerEncoder(layer, a.layers, norm=nn.LayerNorm(a.d_model))
        self.forecast_head = nn.Linear(n * a.d_model, a.horizon)
        self.recon_head = nn.Linear(a.d_model, a.patch)

    def forward(self, x, mask_ratio=0.0):  # x (B, L, C)
        B, L, C = x.shape
        mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True) + 1e-5
        z = ((x - mu) / sd).transpose(1, 2).reshape(B * C, L)
        patches = z.unfold(-1, self.patch, self.stride)
        tok = self.embed(patches)
        if mask_ratio > 0:
            m = torch.rand(tok.shape[:2], device=x.device) < mask_ratio
            tok = torch.where(m.unsqueeze(-1), self.mask_token.expand_as(tok), tok)
        h = self.enc(tok + self.pos)
        y = self.forecast_head(h.flatten(1)).view(B, C, self.h).transpose(1, 2) * sd + mu
        if mask_ratio > 0:
            rec = self.recon_head(h)
            aux = ((rec - patches) ** 2).mean(-1)
            aux = (aux * m).sum() / m.sum().clamp_min(1)
            return y, aux
        return y, None


def load_farm(farm_dir):
    train, val = [], []
    files = sorted(glob.glob(os.path.join(farm_dir, "WT*.parquet")))
    for f in files:
        df = pd.read_parquet(f, columns=SIGNALS).interpolate(limit=6).ffill().bfill()
        a = df.to_numpy(np.float32)
        n_tr = int(0.8 * len(a))
        mean, std = a[:n_tr].mean(0), a[:n_tr].std(0) + 1e-6  # per turbine, per signal
        a = ((a - mean) / std).astype(np.float32)
        train.append(a[:n_tr])
        val.append(a[n_tr:])
    return train, val, [os.path.basename(f) for f in files]


@torch.no_grad()
def evaluate(model, loader, device, horizon):
    model.eval()
    cut = {"1h": 6, "6h": 36, "24h": 144}
    cut = {k: v for k, v in cut.items() if v <= horizon}
    acc = torch.zeros(len(cut) + 1, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred, _ = model(x)
        err = (pred - y).abs()
        for j, h in enumerate(cut.values()):
            acc[j] += err[:, :h].mean(dim=(1, 2)).sum()
        acc[-1] += x.shape[0]
    dist.all_reduce(acc)
    model.train()
    return {f"mae_{k}": (acc[j] / acc[-1]).item() for j, k in enumerate(cut)}


def main():
    a = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(8)

    train_arrs, val_arrs, turbines = load_farm(a.farm_dir)
    train_ds = ConcatDataset([TurbineWindows(t, a.lookback, a.horizon, hop=6) for t in train_arrs])
    val_ds = ConcatDataset([TurbineWindows(v, a.lookback, a.horizon, hop=a.horizon) for v in val_arrs])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=6, pin_memory=True)

    model = DDP(AuxPatchTST(a).to(device), device_ids=[local_rank])
    lr = a.lr * world
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=a.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.2)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        print(f"{len(turbines)} turbines, {len(train_ds)} train / {len(val_ds)} val windows")

    best, step = float("inf"), 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            use_aux = step % a.aux_every == 0
            pred, aux = model(x, a.mask_ratio if use_aux else 0.0)
            loss = F.mse_loss(pred, y)
            if aux is not None:
                loss = loss + a.aux_weight * aux
                acc[1] += aux.detach()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            acc[0] += loss.detach()
            acc[2] += 1
            step += 1
        dist.all_reduce(acc)

        m = evaluate(model, val_dl, device, a.horizon)
        score = sum(m.values()) / len(m)
        if rank == 0:
            print(f"epoch {epoch} loss {(acc[0] / acc[2]).item():.4f} "
                  f"aux {(acc[1] / acc[2] * a.aux_every).item():.4f} "
                  + " ".join(f"{k}={v:.4f}" for k, v in m.items())
                  + f" ({time.time() - t0:.0f}s)", flush=True)
            if score < best:
                best = score
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m},
                           os.path.join(a.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
