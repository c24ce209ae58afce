"""Railway traction-motor condition monitoring.

Channel-independent patch autoencoder over per-sensor windows (winding temps,
phase currents, bearing vibration RMS). Each sensor gets its own alarm threshold
= high quantile of its validation reconstruction errors; a window alarms if any
sensor exceeds its threshold. Test F1 is computed against the maintenance log.

    torchrun --standalone --nproc_per_node=4 19_traction_motor_thresholds.py --data /shared/rail/tm_fleet.npz
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/traction_motor")
    p.add_argument("--win", type=int, default=256)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--q", type=float, default=0.999)
    return p.parse_args()


class MultiSensorWindows(Dataset):
    def __init__(self, x, labels, win, hop):
        self.x, self.labels, self.win = x, labels, win
        self.starts = np.arange(0, len(x) - win + 1, hop)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = self.starts[i]
        lab = 0 if self.labels is None else int(self.labels[s:s + self.win].any())
        return torch.from_numpy(self.x[s:s + self.win]), lab


class ChannelAE(nn.Module):
    """Shared-weight autoencoder applied to each sensor channel independently."""

    def __init__(self, a):
        super().__init__()
        self.patch = a.patch
        n = a.win // a.patch
        self.embed = nn.Linear(a.patch, a.dim)
        self.pos = nn.Parameter(torch.zeros(1, n, a.dim))
        layer = nn.TransformerEncoderLayer(a.dim, 4, 4 * a.dim, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, a.depth, norm=nn.LayerNorm(a.dim))
        self.squeeze = nn.Linear(a.dim, a.dim // 8)
        self.unsqueeze = nn.Linear(a.dim // 8, a.dim)
        self.out = nn.Linear(a.dim, a.patch)

    def forward(self, x):  # (B, W, C) -> per-sensor recon error (B, C), recon (B, W, C)
        B, W, C = x.shape
        z = x.transpose(1, 2).reshape(B * C, W // self.patch, self.patch)
        h = self.enc(self.embed(z) + self.pos)
        rec = self.out(self.unsqueeze(torch.tanh(self.squeeze(h))))
        rec = rec.reshape(B, C, W).transpose(1, 2)
        return (rec - x).pow(2).mean(1), rec


@torch.no_grad()
def sensor_errors(model, loader, device):
    model.eval()
    errs, labs = [], []
    for x, y in loader:
        e, _ = model(x.to(device, non_blocking=True))
        errs.append(e.cpu())
        labs.append(y)
    model.train()
    return torch.cat(errs).numpy(), torch.cat(labs).numpy()


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(21)

    z = np.load(a.data)
    train_x, val_x, test_x, test_y = z["train"], z["val"], z["test"], z["test_labels"]
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6  # per-sensor, healthy period
    f = lambda v: ((v - mean) / std).astype(np.float32)
    train_ds = MultiSensorWindows(f(train_x), None, a.win, hop=8)
    val_ds = MultiSensorWindows(f(val_x), None, a.win, hop=a.win // 2)
    test_ds = MultiSensorWindows(f(test_x), test_y, a.win, hop=a.win // 2)

    samplers = {k: DistributedSampler(ds, shuffle=(k == "train"), drop_last=(k != "train"))
                for k, ds in (("train", train_ds), ("val", val_ds), ("test", test_ds))}
    train_dl = DataLoader(train_ds, batch_size=a.batch, sampler=samplers["train"], num_workers=6,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=512, sampler=samplers["val"], num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=512, sampler=samplers["test"], num_workers=4)

    model = DDP(ChannelAE(a).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr * world, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.epochs)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    for epoch in range(a.epochs):
        samplers["train"].set_epoch(epoch)
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, _ in train_dl:
            x = x.to(device, non_blocking=True)
            err, _ = model(x)
            loss = err.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc[0] += loss.detach() * x.shape[0]
            acc[1] += x.shape[0]
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} recon {(acc[0] / acc[1]).item():.5f} ({time.time() - t0:.0f}s)",
                  flush=True)

    # per-sensor thresholds from validation errors
    val_err, _ = sensor_errors(model, val_dl, device)
    thresholds = np.quantile(val_err, a.q, axis=0)  # (C,)

    test_err, test_lab = sensor_errors(model, test_dl, device)
    alarm = (test_err > thresholds[None, :]).any(1)
    counts = torch.tensor([np.sum(alarm & (test_lab == 1)), np.sum(alarm & (test_lab == 0)),
                           np.sum(~alarm & (test_lab == 1))], device=device, dtype=torch.float64)
    dist.all_reduce(counts)
    tp, fp, fn = counts.tolist()
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    f1 = 2 * prec * rec / max(prec + rec, 1e-9)

    if rank == 0:
        print(f"TEST precision {prec:.3f} recall {rec:.3f} F1 {f1:.3f}")
        torch.save({"model": model.module.state_dict(), "thresholds": torch.from_numpy(thresholds),
                    "mean": torch.from_numpy(mean), "std": torch.from_numpy(std), "q": a.q},
                   os.path.join(a.out, "tm_ae.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
