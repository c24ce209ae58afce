"""Modern U-Net surrogate (PDEArena-style) for 2D shallow water on a lat-lon grid.

Trains one-step prediction with temporal bundling, validates with full autoregressive
rollouts. Configuration comes from a YAML file, overridable from the command line.

    torchrun --nproc_per_node=4 07_unet_surrogate_shallow_water.py --config configs/swe_unet.yaml
"""
import argparse
import dataclasses
import glob
import math
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


@dataclasses.dataclass
class Config:
    data_dir: str = "/data/pdearena/ShallowWater2DVel-2Day"
    out_dir: str = "outputs/swe_unet"
    time_history: int = 2
    time_future: int = 1
    hidden: int = 64
    ch_mults: tuple = (1, 2, 2, 4)
    batch_size: int = 8
    lr: float = 2e-4
    weight_decay: float = 1e-5
    epochs: int = 50
    warmup_epochs: int = 2
    rollout_steps: int = 20
    num_workers: int = 8
    seed: int = 42


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--override", nargs="*", default=[])
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as fh:
            for k, v in (yaml.safe_load(fh) or {}).items():
                setattr(cfg, k, v)
    for kv in a.override:
        k, v = kv.split("=", 1)
        setattr(cfg, k, type(getattr(cfg, k))(yaml.safe_load(v)))
    return cfg


class SWETrajectories(Dataset):
    """Files: *.h5 with 'u', 'v', 'h' of shape [n_traj, T, H, W]."""

    def __init__(self, files, time_history, time_future, mode="train"):
        self.files, self.th, self.tf, self.mode = files, time_history, time_future, mode
        self.index = []
        for fi, path in enumerate(files):
            with h5py.File(path, "r") as f:
                n, T = f["h"].shape[:2]
            if mode == "train":
                self.index += [(fi, n_, t) for n_ in range(n) for t in range(T - time_history - time_future + 1)]
            else:
                self.index += [(fi, n_, 0) for n_ in range(n)]
        self._handles = {}

    def __len__(self):
        return len(self.index)

    def _f(self, fi):
        if fi not in self._handles:
            self._handles[fi] = h5py.File(self.files[fi], "r")
        return self._handles[fi]

    def __getitem__(self, i):
        fi, n, t = self.index[i]
        f = self._f(fi)
        if self.mode == "train":
            sl = slice(t, t + self.th + self.tf)
        else:
            sl = slice(None)
        x = np.stack([f[k][n, sl] for k in ("u", "v", "h")], axis=1).astype(np.float32)  # [T, 3, H, W]
        x = torch.from_numpy(x)
        return x[: self.th], x[self.th:]


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n1 = nn.GroupNorm(8, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.n2 = nn.GroupNorm(8, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.gelu(self.n1(x)))
        h = self.c2(F.gelu(self.n2(h)))
        return h + self.skip(x)


class UNet(nn.Module):
    def __init__(self, n_vars, time_history, time_future, hidden, ch_mults):
        super().__init__()
        self.n_vars = n_vars
        self.time_history = time_history
        self.time_future = time_future
        cin, cout = n_vars * time_history, n_vars * time_future
        self.inp = nn.Conv2d(cin, hidden, 3, padding=1)
        chans = [hidden * m for m in ch_mults]
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        c = hidden
        skips = []
        for i, ch in enumerate(chans):
            self.down.append(ResBlock(c, ch))
            skips.append(ch)
            c = ch
        self.mid = ResBlock(c, c)
        for ch in reversed(chans):
            self.up.append(ResBlock(c + skips.pop(), ch))
            c = ch
        self.out = nn.Conv2d(c, cout, 3, padding=1)

    def forward(self, x):
        # x: [B, th, V, H, W] -> [B, tf, V, H, W]
        b, _, _, H, W = x.shape
        h = self.inp(x.reshape(b, -1, H, W))
        hs = []
        for i, blk in enumerate(self.down):
            h = blk(h)
            hs.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid(h)
        for i, blk in enumerate(self.up):
            skip = hs.pop()
            if h.shape[-2:] != skip.shape[-2:]:
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = blk(torch.cat([h, skip], dim=1))
        out = self.out(h).reshape(b, self.time_future, self.n_vars, H, W)
        return x[:, -1:] + out

    @torch.no_grad()
    def rollout(self, x0, n_steps):
        """Autoregressive rollout from the first `time_history` frames."""
        x, preds = x0, []
        while sum(p.shape[1] for p in preds) < n_steps:
            y = self(x)
            preds.append(y)
            x = torch.cat([x, y], dim=1)[:, -self.time_history:]
        return torch.cat(preds, dim=1)[:, :n_steps]


def lr_lambda(cfg, steps_per_epoch):
    warm = cfg.warmup_epochs * steps_per_epoch
    total = cfg.epochs * steps_per_epoch

    def f(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))
    return f


@torch.no_grad()
def evaluate_rollout(model, loader, n_steps, device):
    model.eval()
    err = torch.zeros(n_steps, device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y[:, :n_steps].to(device)
        preds = model.rollout(x, n_steps)
        err += ((preds - y) ** 2).mean(dim=(2, 3, 4)).sum(0).double()
        count += x.shape[0]
    dist.all_reduce(err)
    dist.all_reduce(count)
    return (err / count).sqrt()


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    train_files = sorted(glob.glob(os.path.join(cfg.data_dir, "train", "*.h5")))
    valid_files = sorted(glob.glob(os.path.join(cfg.data_dir, "valid", "*.h5")))
    train_ds = SWETrajectories(train_files, cfg.time_history, cfg.time_future, "train")
    valid_ds = SWETrajectories(valid_files, cfg.time_history, cfg.time_future, "valid")
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, cfg.batch_size, sampler=train_sampler, num_workers=cfg.num_workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    valid_shard = Subset(valid_ds, range(rank, len(valid_ds), world))
    valid_loader = DataLoader(valid_shard, 4, shuffle=False, num_workers=2)

    net = UNet(3, cfg.time_history, cfg.time_future, cfg.hidden, cfg.ch_mults).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, len(train_loader)))

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as fh:
            yaml.safe_dump({k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}, fh)

    best = float("inf")
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc[0] += loss.detach()
            acc[1] += 1
        dist.all_reduce(acc)

        rmse = evaluate_rollout(model, valid_loader, cfg.rollout_steps, device)
        if rank == 0:
            print(f"epoch {epoch:3d} | {time.time() - tic:6.1f}s | train mse {(acc[0] / acc[1]).item():.3e} | "
                  f"rollout rmse @1 {rmse[0].item():.3e} @{cfg.rollout_steps} {rmse[-1].item():.3e}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "cfg": dataclasses.asdict(cfg)}
            torch.save(state, os.path.join(cfg.out_dir, "last.ckpt"))
            if rmse.mean().item() < best:
                best = rmse.mean().item()
                torch.save(state, os.path.join(cfg.out_dir, "best.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
