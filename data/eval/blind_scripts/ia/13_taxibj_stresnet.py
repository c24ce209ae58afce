"""Citywide crowd-flow forecasting on TaxiBJ with an ST-ResNet.

Inflow/outflow grids (2 x 32 x 32, 30-min slots) are min-max scaled to [-1, 1].
Closeness / period / trend frames feed three residual branches whose outputs are
fused with learned parametric weights plus an external-factor branch.
Test set = last 4 weeks, as in Zhang et al. (AAAI'17).

    torchrun --nproc_per_node=4 13_taxibj_stresnet.py --data_dir /data/TaxiBJ
"""
import argparse
import datetime
import glob
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

T_DAY = 48


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/TaxiBJ")
    p.add_argument("--len_c", type=int, default=3)
    p.add_argument("--len_p", type=int, default=1)
    p.add_argument("--len_t", type=int, default=1)
    p.add_argument("--res_units", type=int, default=12)
    p.add_argument("--filters", type=int, default=64)
    p.add_argument("--test_days", type=int, default=28)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--out", default="ckpt/stresnet_bj")
    return p.parse_args()


def load_flows(data_dir):
    frames, slots = [], []
    for f in sorted(glob.glob(os.path.join(data_dir, "BJ1[3-6]_M32x32_T30_InOut.h5"))):
        with h5py.File(f, "r") as h:
            frames.append(h["data"][()].astype(np.float32))
            slots.append([s.decode() for s in h["date"][()]])
    data = np.concatenate(frames)
    slots = sum(slots, [])
    return data, slots


def slot_to_abs(s):
    d = datetime.date(int(s[:4]), int(s[4:6]), int(s[6:8]))
    return d.toordinal() * T_DAY + int(s[8:]) - 1


def make_samples(data, slots, len_c, len_p, len_t):
    abs_t = [slot_to_abs(s) for s in slots]
    pos = {t: i for i, t in enumerate(abs_t)}
    xc, xp, xt, ext, y = [], [], [], [], []
    for i, t in enumerate(abs_t):
        c_t = [t - k for k in range(1, len_c + 1)]
        p_t = [t - k * T_DAY for k in range(1, len_p + 1)]
        t_t = [t - k * 7 * T_DAY for k in range(1, len_t + 1)]
        # the recording has missing days; skip samples whose context is incomplete
        if any(n not in pos for n in c_t + p_t + t_t):
            continue
        wday = datetime.date.fromordinal(t // T_DAY).weekday()
        e = np.zeros(8, np.float32)
        e[wday] = 1.0
        e[7] = float(wday >= 5)
        xc.append(np.concatenate([data[pos[n]] for n in c_t]))
        xp.append(np.concatenate([data[pos[n]] for n in p_t]))
        xt.append(np.concatenate([data[pos[n]] for n in t_t]))
        ext.append(e)
        y.append(data[i])
    return [torch.from_numpy(np.stack(a)) for a in (xc, xp, xt, ext, y)]


class ResUnit(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1),
                                  nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1))

    def forward(self, x):
        return x + self.body(x)


class Branch(nn.Module):
    def __init__(self, in_ch, filters, units):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(in_ch, filters, 3, padding=1),
                                 *[ResUnit(filters) for _ in range(units)],
                                 nn.ReLU(), nn.Conv2d(filters, 2, 3, padding=1))

    def forward(self, x):
        return self.net(x)


class STResNet(nn.Module):
    def __init__(self, len_c, len_p, len_t, filters, units, ext_dim=8, hw=(32, 32)):
        super().__init__()
        self.c = Branch(2 * len_c, filters, units)
        self.p = Branch(2 * len_p, filters, units)
        self.t = Branch(2 * len_t, filters, units)
        self.wc, self.wp, self.wt = (nn.Parameter(torch.ones(1, 2, *hw)) for _ in range(3))
        self.ext = nn.Sequential(nn.Linear(ext_dim, 10), nn.ReLU(), nn.Linear(10, 2 * hw[0] * hw[1]))
        self.hw = hw

    def forward(self, xc, xp, xt, e):
        fused = self.wc * self.c(xc) + self.wp * self.p(xp) + self.wt * self.t(xt)
        return torch.tanh(fused + self.ext(e).view(-1, 2, *self.hw))


def evaluate(net, loader, device, scale):
    net.eval()
    sse, count = 0.0, 0
    with torch.no_grad():
        for xc, xp, xt, e, y in loader:
            xc, xp, xt, e, y = (a.to(device) for a in (xc, xp, xt, e, y))
            pred = net(xc, xp, xt, e)
            sse += F.mse_loss(pred * scale, y * scale, reduction="sum").item()
            count += y.numel()
    stats = torch.tensor([sse, count], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    net.train()
    return float(np.sqrt(stats[0] / stats[1]))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    data, slots = load_flows(args.data_dir)
    n_test_slots = args.test_days * T_DAY
    mmn_max, mmn_min = data[:-n_test_slots].max(), data[:-n_test_slots].min()  # fit on train part only
    scaled = 2.0 * (data - mmn_min) / (mmn_max - mmn_min) - 1.0
    xc, xp, xt, ext, y = make_samples(scaled, slots, args.len_c, args.len_p, args.len_t)
    n_test = min(n_test_slots, len(y))
    full = TensorDataset(xc, xp, xt, ext, y)
    train_ds = Subset(full, range(0, len(y) - n_test))
    test_ds = Subset(full, range(len(y) - n_test, len(y)))
    scale = (mmn_max - mmn_min) / 2.0

    sampler = DistributedSampler(train_ds, shuffle=True, seed=1)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    test_part = Subset(test_ds, range(rank, len(test_ds), world))
    test_dl = DataLoader(test_part, batch_size=256, shuffle=False)

    net = STResNet(args.len_c, args.len_p, args.len_t, args.filters, args.res_units)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"slots={len(data)} train={len(train_ds)} test={len(test_ds)} scale={scale:.1f}", flush=True)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for xc_b, xp_b, xt_b, e_b, y_b in train_dl:
            xc_b, xp_b, xt_b, e_b, y_b = (a.to(device, non_blocking=True) for a in (xc_b, xp_b, xt_b, e_b, y_b))
            loss = F.mse_loss(model(xc_b, xp_b, xt_b, e_b), y_b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            rmse = evaluate(net, test_dl, device, scale)
            if rank == 0:
                print(f"epoch {epoch} train_mse {(tot[0] / tot[1]).item():.5f} test RMSE {rmse:.2f} "
                      f"({time.time() - t0:.1f}s)", flush=True)
                if rmse < best:
                    best = rmse
                    torch.save({"model": net.state_dict(), "epoch": epoch, "rmse": rmse,
                                "mmn": (float(mmn_min), float(mmn_max))}, os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
