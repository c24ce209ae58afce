"""Paper-machine quality sensors (basis weight, moisture, caliper profiles) -
PatchTST forecaster + residual-based sheet-break early warning.

The alert threshold on the forecast residual is the 99.5th percentile of the
validation residuals of normal running.

  torchrun --standalone --nproc_per_node=8 15_paper_machine_wandb.py --data /nfs/pm4/pm4_2023.parquet
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--project", default="pm4-forecast")
    p.add_argument("--run-name", default=None)
    p.add_argument("--ckpt-dir", default="checkpoints/pm4")
    p.add_argument("--lookback", type=int, default=360)
    p.add_argument("--horizon", type=int, default=60)
    p.add_argument("--patch", type=int, default=12)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--alert-quantile", type=float, default=0.995)
    return p.parse_args()


class Windows(Dataset):
    def __init__(self, arr, lookback, horizon, hop):
        self.arr, self.lb, self.h = arr, lookback, horizon
        self.starts = np.arange(0, len(arr) - lookback - horizon + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        return (torch.from_numpy(self.arr[s:s + self.lb]),
                torch.from_numpy(self.arr[s + self.lb:s + self.lb + self.h]), i)


class PatchTST(nn.Module):
    def __init__(self, n_ch, a):
        super().__init__()
        n = a.lookback // a.patch
        self.patch, self.h = a.patch, a.horizon
        self.embed = nn.Linear(a.patch, a.d_model)
        self.pos = nn.Parameter(torch.zeros(1, n, a.d_model))
        layer = nn.TransformerEncoderLayer(a.d_model, 8, 256, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, a.layers, norm=nn.LayerNorm(a.d_model))
        self.head = nn.Linear(n * a.d_model, a.horizon)

    def forward(self, x):
        B, L, C = x.shape
        mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True) + 1e-5
        z = ((x - mu) / sd).transpose(1, 2).reshape(B * C, L // self.patch, self.patch)
        y = self.head(self.enc(self.embed(z) + self.pos).flatten(1))
        return y.view(B, C, self.h).transpose(1, 2) * sd + mu


@torch.no_grad()
def collect_residuals(model, loader, device, world, n_total):
    """Per-window max |residual| over sensors, gathered from all ranks (padding removed)."""
    model.eval()
    idx, res = [], []
    for x, y, i in loader:
        x, y = x.to(device), y.to(device)
        res.append((model(x) - y).abs().amax(dim=(1, 2)))
        idx.append(i.to(device))
    model.train()
    local = torch.stack([torch.cat(idx).double(), torch.cat(res).double()], 1)
    bufs = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(bufs, local)
    allv = torch.cat(bufs).cpu().numpy()
    _, first = np.unique(allv[:, 0], return_index=True)
    assert len(first) == n_total
    return allv[first, 1]


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    wandb.init(project=a.project, name=a.run_name, config=vars(a))

    df = pd.read_parquet(a.data)
    running = df.pop("machine_running").astype(bool).to_numpy()
    arr = df.to_numpy(np.float32)
    n = len(arr)
    n_tr, n_va = int(0.7 * n), int(0.15 * n)
    mu = arr[:n_tr][running[:n_tr]].mean(0)
    sd = arr[:n_tr][running[:n_tr]].std(0) + 1e-6
    arr = ((arr - mu) / sd).astype(np.float32)
    train_ds = Windows(arr[:n_tr], a.lookback, a.horizon, hop=3)
    val_ds = Windows(arr[n_tr - a.lookback:n_tr + n_va], a.lookback, a.horizon, hop=a.horizon)

    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=tr_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=va_sampler, num_workers=4, pin_memory=True)

    model = DDP(PatchTST(arr.shape[1], a).to(device), device_ids=[local_rank])
    lr = a.lr * world * a.batch / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=a.epochs,
                                                steps_per_epoch=len(train_dl))
    if rank == 0:
        os.makedirs(a.ckpt_dir, exist_ok=True)

    best = float("inf")
    step = 0
    for epoch in range(a.epochs):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y, _ in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc[0] += loss.detach()
            acc[1] += 1
            step += 1
        dist.all_reduce(acc)

        resid = collect_residuals(model, val_dl, device, world, len(val_ds))
        thr = float(np.quantile(resid, a.alert_quantile))
        val_mae_max = float(resid.mean())
        wandb.log({"train/mse": (acc[0] / acc[1]).item(), "val/max_abs_resid": val_mae_max,
                   "val/alert_threshold": thr, "lr": sched.get_last_lr()[0],
                   "epoch": epoch, "time/epoch_s": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} val resid {val_mae_max:.4f} thr {thr:.4f}", flush=True)
            if val_mae_max < best:
                best = val_mae_max
                torch.save({"model": model.module.state_dict(), "threshold": thr,
                            "mu": torch.from_numpy(mu), "sd": torch.from_numpy(sd), "epoch": epoch},
                           os.path.join(a.ckpt_dir, "best.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
