"""Interpretable N-BEATS (trend + seasonality stacks) + generic stack, FSDP.

Hourly electricity panel, rolling-origin validation (one fold per week of the
validation period).  Checkpoints are full (unsharded) state dicts so they can
be loaded by the single-GPU inference service.

    torchrun --nproc_per_node=8 14_nbeats_interp_fsdp.py --width 4096
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/shared/data/elec/LD2011_2014.txt")
    p.add_argument("--cache", default="/shared/data/elec/hourly_scaled.npz")
    p.add_argument("--ckpt", default="/shared/ckpt/nbeats_interp")
    p.add_argument("--L", type=int, default=168 * 2)
    p.add_argument("--H", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--trend_degree", type=int, default=3)
    p.add_argument("--harmonics", type=int, default=12)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--eval_every", type=int, default=2000)
    p.add_argument("--val_weeks", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def prepare(csv, out):
    import pandas as pd
    df = pd.read_csv(csv, sep=";", decimal=",", index_col=0, parse_dates=True)
    hourly = df.resample("1h").sum().iloc[24 * 365:]          # drop 2011 (mostly zeros)
    v = hourly.to_numpy(np.float32).T                            # (N, T)
    t_tr = v.shape[1] - 24 * 7 * 8
    mu, sd = v[:, :t_tr].mean(1, keepdims=True), v[:, :t_tr].std(1, keepdims=True) + 1e-3
    tmp = out + ".tmp.npz"
    np.savez(tmp, y=((v - mu) / sd).astype(np.float32), mu=mu, sd=sd, t_tr=t_tr)
    os.replace(tmp, out)


class Windows(Dataset):
    def __init__(self, y, L, H, ends):
        self.y, self.L, self.H = y, L, H
        self.items = [(s, e) for e in ends for s in range(y.shape[0])]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, e = self.items[i]
        return torch.from_numpy(self.y[s, e - self.L:e]), torch.from_numpy(self.y[s, e:e + self.H])


class Block(nn.Module):
    def __init__(self, L, H, width, basis_b, basis_f):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(L, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        if basis_b is None:       # generic block: learned basis
            self.theta_b, self.theta_f = nn.Linear(width, L), nn.Linear(width, H)
            self.register_buffer("Bb", torch.eye(L), persistent=False)
            self.register_buffer("Bf", torch.eye(H), persistent=False)
        else:
            self.theta_b = nn.Linear(width, basis_b.shape[0], bias=False)
            self.theta_f = nn.Linear(width, basis_f.shape[0], bias=False)
            self.register_buffer("Bb", basis_b, persistent=False)
            self.register_buffer("Bf", basis_f, persistent=False)

    def forward(self, x):
        h = self.fc(x)
        return self.theta_b(h) @ self.Bb, self.theta_f(h) @ self.Bf


def trend_basis(deg, n, offset=0, total=None):
    t = (torch.arange(n) + offset) / (total or n)
    return torch.stack([t ** p for p in range(deg + 1)])


def season_basis(k, n, offset=0, period=24):
    t = (torch.arange(n) + offset) * 2 * math.pi / period
    rows = [torch.ones(n)] + [f(j * t) for j in range(1, k + 1) for f in (torch.cos, torch.sin)]
    return torch.stack(rows)


class NBeatsI(nn.Module):
    def __init__(self, a):
        super().__init__()
        L, H = a.L, a.H
        blocks = []
        for _ in range(a.blocks):
            blocks.append(Block(L, H, a.width, trend_basis(a.trend_degree, L, 0, L + H),
                                trend_basis(a.trend_degree, H, L, L + H)))
        for _ in range(a.blocks):
            blocks.append(Block(L, H, a.width, season_basis(a.harmonics, L), season_basis(a.harmonics, H, L)))
        for _ in range(a.blocks):
            blocks.append(Block(L, H, a.width, None, None))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        res, fc = x, 0.0
        for b in self.blocks:
            back, f = b(res)
            res = res - back
            fc = fc + f
        return fc


@torch.no_grad()
def rolling_eval(model, loaders, dev):
    model.eval()
    out = []
    for dl in loaders:
        n_real = len(dl.sampler.dataset)
        acc = torch.zeros(3, device=dev, dtype=torch.float64)
        for j, (x, y) in enumerate(dl):
            x, y = x.to(dev), y.to(dev)
            e = model(x) - y
            # drop the duplicates DistributedSampler appends to even out the shards
            pos = dl.sampler.rank + dl.sampler.num_replicas * (j * dl.batch_size + torch.arange(len(x), device=dev))
            w = (pos < n_real).double()[:, None]
            acc += torch.stack([(w * e.double() ** 2).sum(), (w * e.double().abs()).sum(), w.sum() * e.shape[1]])
        dist.all_reduce(acc)
        out.append(((acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()))
    model.train()
    return out


def save(model, opt, step, path, rank):
    # every rank enters the state_dict calls (they gather shards); only rank 0 writes
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    if rank == 0 and not os.path.exists(a.cache):
        prepare(a.csv, a.cache)
    dist.barrier()
    z = np.load(a.cache)
    y, t_tr = z["y"], int(z["t_tr"])

    tr = Windows(y, a.L, a.H, range(a.L, t_tr - a.H + 1))
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True, seed=3)
    dl = DataLoader(tr, a.batch, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    folds = []
    for k in range(a.val_weeks):
        origin = t_tr + k * 24 * 7
        ds = Windows(y, a.L, a.H, range(origin, origin + 24 * 7, a.H))
        folds.append(DataLoader(ds, 2048, sampler=DistributedSampler(ds, shuffle=False), num_workers=2))

    model = FSDP(NBeatsI(a), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=local_rank,
                 use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    os.makedirs(a.ckpt, exist_ok=True)
    last = os.path.join(a.ckpt, "last.pt")
    step, epoch, best = 0, 0, float("inf")
    if a.resume and os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            model.load_state_dict(ck["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ck["optim"]))
        step = ck["step"]
        epoch = step // len(dl)

    t0 = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, yt in dl:
            x, yt = x.to(dev, non_blocking=True), yt.to(dev, non_blocking=True)
            loss = F.l1_loss(model(x), yt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            step += 1
            if step % a.eval_every == 0:
                res = rolling_eval(model, folds, dev)
                mae = float(np.mean([r[1] for r in res]))
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} folds mae {[round(r[1], 4) for r in res]} "
                          f"mean {mae:.4f} ({time.time() - t0:.0f}s)", flush=True)
                save(model, opt, step, last, rank)
                if mae < best:
                    best = mae
                    save(model, opt, step, os.path.join(a.ckpt, "best.pt"), rank)
            if step >= a.steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
