"""FNO-2D with recurrent time stepping on 2D Navier-Stokes (vorticity), nu=1e-4.

Input: the first 10 vorticity snapshots, output: the next 20, predicted one step at a
time and trained with the full autoregressive rollout loss.

    torchrun --standalone --nproc_per_node=4 06_fno_navier_stokes_rollout.py \
        --data /data/fno/NavierStokes_V1e-4_N10000_T30.mat --run-dir runs/ns1e-4
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-dir", default="runs/ns")
    p.add_argument("--ntrain", type=int, default=9800)
    p.add_argument("--nval", type=int, default=200)
    p.add_argument("--t-in", type=int, default=10)
    p.add_argument("--t-out", type=int, default=20)
    p.add_argument("--modes", type=int, default=12)
    p.add_argument("--width", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--scheduler-step", type=int, default=100)
    p.add_argument("--scheduler-gamma", type=float, default=0.5)
    return p.parse_args()


def load_ns(path, n, t_total):
    with h5py.File(path, "r") as f:
        u = f["u"][:t_total, :, :, :n]  # MATLAB order: [T, Y, X, N]
    u = np.transpose(u, (3, 2, 1, 0)).astype(np.float32)  # [N, X, Y, T]
    return torch.from_numpy(u)


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, modes1, modes2):
        super().__init__()
        self.modes1, self.modes2 = modes1, modes2
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, dtype=torch.cfloat))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, modes1, modes2, dtype=torch.cfloat))

    @staticmethod
    def compl_mul2d(a, w):
        return torch.einsum("bixy,ioxy->boxy", a, w)

    def forward(self, x):
        B = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(B, self.weights1.shape[1], x.size(-2), x.size(-1) // 2 + 1,
                             dtype=torch.cfloat, device=x.device)
        out_ft[:, :, :self.modes1, :self.modes2] = self.compl_mul2d(x_ft[:, :, :self.modes1, :self.modes2], self.weights1)
        out_ft[:, :, -self.modes1:, :self.modes2] = self.compl_mul2d(x_ft[:, :, -self.modes1:, :self.modes2], self.weights2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO2dTime(nn.Module):
    def __init__(self, modes, width, t_in):
        super().__init__()
        self.fc0 = nn.Linear(t_in + 2, width)
        self.convs = nn.ModuleList([SpectralConv2d(width, width, modes, modes) for _ in range(4)])
        self.ws = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(4)])
        self.norm = nn.InstanceNorm2d(width)
        self.fc1 = nn.Linear(width, 128)
        self.fc2 = nn.Linear(128, 1)

    def forward(self, x):
        b, sx, sy, _ = x.shape
        gx = torch.linspace(0, 1, sx, device=x.device).view(1, sx, 1, 1).repeat(b, 1, sy, 1)
        gy = torch.linspace(0, 1, sy, device=x.device).view(1, 1, sy, 1).repeat(b, sx, 1, 1)
        x = self.fc0(torch.cat((x, gx, gy), dim=-1)).permute(0, 3, 1, 2)
        for i in range(4):
            x = self.norm(self.convs[i](self.norm(x))) + self.ws[i](x)
            if i < 3:
                x = F.gelu(x)
        x = x.permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x)))


def rel_l2_per_sample(pred, target):
    b = pred.shape[0]
    return (pred.reshape(b, -1) - target.reshape(b, -1)).norm(dim=1) / target.reshape(b, -1).norm(dim=1)


def rollout(model, xx, steps):
    preds = []
    for _ in range(steps):
        im = model(xx)
        preds.append(im)
        xx = torch.cat((xx[..., 1:], im), dim=-1)
    return torch.cat(preds, dim=-1)


@torch.no_grad()
def validate(model, loader, t_out, device):
    model.eval()
    step_err, full_err, n = 0.0, 0.0, 0
    for xx, yy in loader:
        xx, yy = xx.to(device), yy.to(device)
        pred = rollout(model, xx, t_out)
        for t in range(t_out):
            step_err += rel_l2_per_sample(pred[..., t], yy[..., t]).sum().item()
        full_err += rel_l2_per_sample(pred, yy).sum().item()
        n += xx.shape[0]
    return step_err / (n * t_out), full_err / n


def main():
    cfg = get_config()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    data = load_ns(cfg.data, cfg.ntrain + cfg.nval, cfg.t_in + cfg.t_out)
    train = TensorDataset(data[:cfg.ntrain, ..., :cfg.t_in], data[:cfg.ntrain, ..., cfg.t_in:])
    val = TensorDataset(data[-cfg.nval:, ..., :cfg.t_in], data[-cfg.nval:, ..., cfg.t_in:])
    train_sampler = DistributedSampler(train, shuffle=True)
    val_sampler = DistributedSampler(val, shuffle=False)
    train_loader = DataLoader(train, batch_size=cfg.batch_size, sampler=train_sampler, num_workers=2, pin_memory=True)
    val_loader = DataLoader(val, batch_size=cfg.batch_size, sampler=val_sampler, num_workers=2)

    model = DDP(FNO2dTime(cfg.modes, cfg.width, cfg.t_in).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.scheduler_step, gamma=cfg.scheduler_gamma)

    writer = None
    if rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        writer = SummaryWriter(cfg.run_dir)
    best = float("inf")

    for ep in range(cfg.epochs):
        train_sampler.set_epoch(ep)
        model.train()
        t1 = time.time()
        train_l2, nb = 0.0, 0
        for xx, yy in train_loader:
            xx, yy = xx.to(device, non_blocking=True), yy.to(device, non_blocking=True)
            pred = rollout(model, xx, cfg.t_out)
            loss = sum(rel_l2_per_sample(pred[..., t], yy[..., t]).mean() for t in range(cfg.t_out))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            train_l2 += loss.item() / cfg.t_out
            nb += 1
        scheduler.step()

        val_step, val_full = validate(model, val_loader, cfg.t_out, device)
        if rank == 0:
            dt = time.time() - t1
            print(f"ep {ep:3d} {dt:6.1f}s train {train_l2 / nb:.5f} val-step {val_step:.5f} val-full {val_full:.5f}",
                  flush=True)
            writer.add_scalar("train/rel_l2_step", train_l2 / nb, ep)
            writer.add_scalar("val/rel_l2_step", val_step, ep)
            writer.add_scalar("val/rel_l2_full", val_full, ep)
            if val_full < best:
                best = val_full
                torch.save({"model": model.module.state_dict(), "epoch": ep, "val_full": val_full},
                           os.path.join(cfg.run_dir, "best.pt"))
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": ep},
                       os.path.join(cfg.run_dir, "last.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
