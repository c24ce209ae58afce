"""FNO-3D for 2D Navier-Stokes (vorticity, nu=1e-4): maps the first 10 time steps
to the next 40, space-time convolution in Fourier space.

Jobs are chained on SLURM (8 h limit), each one resuming from the last checkpoint:

    torchrun --nproc_per_node=8 10_fno3d_navier_stokes.py \
        --resume /p/scratch/sciml/fno3d_ns/last.pt
"""
import argparse
import math
import os
import time
from dataclasses import asdict, dataclass

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class Config:
    data: str = "/p/scratch/sciml/data/ns_V1e-4_N10000_T50.h5"
    out_dir: str = "/p/scratch/sciml/fno3d_ns"
    ntrain: int = 9000
    ntest: int = 1000
    t_in: int = 10
    t_out: int = 40
    modes: int = 8
    modes_t: int = 8
    width: int = 20
    batch_size: int = 4
    lr: float = 1e-3
    epochs: int = 500
    warmup_epochs: int = 5
    save_every: int = 5


class SpectralConv3d(nn.Module):
    def __init__(self, cin, cout, m1, m2, m3):
        super().__init__()
        self.m = (m1, m2, m3)
        scale = 1 / (cin * cout)
        self.weights = nn.ParameterList(
            [nn.Parameter(scale * torch.rand(cin, cout, m1, m2, m3, dtype=torch.cfloat)) for _ in range(4)])

    def forward(self, x):
        m1, m2, m3 = self.m
        B, _, X, Y, T = x.shape
        xf = torch.fft.rfftn(x, dim=[-3, -2, -1])
        out = torch.zeros(B, self.weights[0].shape[1], X, Y, T // 2 + 1, dtype=torch.cfloat, device=x.device)
        corners = [(slice(None, m1), slice(None, m2)), (slice(-m1, None), slice(None, m2)),
                   (slice(None, m1), slice(-m2, None)), (slice(-m1, None), slice(-m2, None))]
        for w, (sx, sy) in zip(self.weights, corners):
            out[:, :, sx, sy, :m3] = torch.einsum("bixyz,ioxyz->boxyz", xf[:, :, sx, sy, :m3], w)
        return torch.fft.irfftn(out, s=(X, Y, T), dim=[-3, -2, -1])


class FNO3d(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        w = cfg.width
        self.pad = 6
        self.p = nn.Linear(cfg.t_in + 3, w)
        self.convs = nn.ModuleList([SpectralConv3d(w, w, cfg.modes, cfg.modes, cfg.modes_t) for _ in range(4)])
        self.ws = nn.ModuleList([nn.Conv3d(w, w, 1) for _ in range(4)])
        self.q = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, 1))

    def forward(self, x):
        # x: (B, X, Y, T, t_in + 3) -- input steps repeated along T plus (x, y, t) grid
        x = self.p(x).permute(0, 4, 1, 2, 3)
        x = F.pad(x, [0, self.pad])
        for i, (k, w) in enumerate(zip(self.convs, self.ws)):
            x = k(x) + w(x)
            if i < 3:
                x = F.gelu(x)
        x = x[..., : -self.pad].permute(0, 2, 3, 4, 1)
        return self.q(x).squeeze(-1)


def build_inputs(a, t_out):
    B, S, _, t_in = a.shape
    gx = torch.linspace(0, 1, S).view(1, S, 1, 1, 1).expand(B, S, S, t_out, 1)
    gy = torch.linspace(0, 1, S).view(1, 1, S, 1, 1).expand(B, S, S, t_out, 1)
    gt = torch.linspace(0, 1, t_out).view(1, 1, 1, t_out, 1).expand(B, S, S, t_out, 1)
    a = a.unsqueeze(3).expand(B, S, S, t_out, t_in)
    return torch.cat([a, gx, gy, gt], dim=-1)


def load(cfg):
    with h5py.File(cfg.data, "r") as f:
        u = torch.from_numpy(f["u"][: cfg.ntrain + cfg.ntest].astype(np.float32))  # N, 64, 64, 50
    a, y = u[..., : cfg.t_in], u[..., cfg.t_in: cfg.t_in + cfg.t_out]
    return (TensorDataset(a[: cfg.ntrain], y[: cfg.ntrain]),
            TensorDataset(a[cfg.ntrain:], y[cfg.ntrain:]))


def rel_l2_sum(pred, y):
    B = pred.shape[0]
    return (torch.linalg.norm((pred - y).reshape(B, -1), dim=1) / torch.linalg.norm(y.reshape(B, -1), dim=1)).sum()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default=None)
    parser.add_argument("--wandb-project", default="fno3d-ns")
    args = parser.parse_args()
    cfg = Config()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, test_ds = load(cfg)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False, drop_last=True)  # 1000 / 8 divides evenly
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=2, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=cfg.batch_size, sampler=test_sampler, num_workers=2)

    model = DDP(FNO3d(cfg).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    steps_per_epoch = len(train_loader)

    def lr_lambda(step):
        e = step / steps_per_epoch
        if e < cfg.warmup_epochs:
            return (step + 1) / (cfg.warmup_epochs * steps_per_epoch)
        return 0.5 * (1 + math.cos(math.pi * (e - cfg.warmup_epochs) / (cfg.epochs - cfg.warmup_epochs)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    start_epoch, best = 0, float("inf")
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        del ckpt

    run = None
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        run = wandb.init(project=args.wandb_project, config=asdict(cfg), resume="allow",
                         id=os.environ.get("SLURM_JOB_NAME", None))

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for a, y in train_loader:
            x = build_inputs(a, cfg.t_out).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            out = model(x)
            loss = rel_l2_sum(out, y) / x.shape[0]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tr += torch.stack([loss.detach() * x.shape[0], torch.tensor(float(x.shape[0]), device=device)])

        model.eval()
        te = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, y in test_loader:
                x, y = build_inputs(a, cfg.t_out).to(device), y.to(device)
                te[0] += rel_l2_sum(model(x), y)
                te[1] += x.shape[0]
        dist.all_reduce(tr)
        dist.all_reduce(te)
        train_err, test_err = (tr[0] / tr[1]).item(), (te[0] / te[1]).item()

        if rank == 0:
            run.log({"train/rel_l2": train_err, "test/rel_l2": test_err, "lr": sched.get_last_lr()[0],
                     "epoch_time": time.time() - t0}, step=epoch)
            print(f"epoch {epoch} train {train_err:.4f} test {test_err:.4f}", flush=True)
            if test_err < best:
                best = test_err
                torch.save(model.module.state_dict(), os.path.join(cfg.out_dir, "best_model.pt"))
            if (epoch + 1) % cfg.save_every == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "epoch": epoch, "best": best},
                           os.path.join(cfg.out_dir, "last.pt"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
