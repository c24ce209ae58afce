"""FNO-2D with recurrent time stepping on 2D Navier-Stokes (vorticity form), nu=1e-4.

Input: vorticity at the first 10 time steps; the network predicts one step at a
time and is rolled out to T=20 further steps (Li et al., fourier_2d_time).

    torchrun --standalone --nproc_per_node=8 08_fno2d_time_navier_stokes.py \
        --data /data/ns/ns_V1e-4_N10000_T30.mat --run-name fno2d-time-w20
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
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--run-name", default="fno2d-time")
    parser.add_argument("--project", default="neural-operators-ns")
    parser.add_argument("--ntrain", type=int, default=9800)
    parser.add_argument("--ntest", type=int, default=200)
    parser.add_argument("--t-in", type=int, default=10)
    parser.add_argument("--t-out", type=int, default=20)
    parser.add_argument("--modes", type=int, default=12)
    parser.add_argument("--width", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--ckpt-dir", default="checkpoints")
    return parser.parse_args()


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, m1, m2):
        super().__init__()
        self.cout, self.m1, self.m2 = cout, m1, m2
        scale = 1 / (cin * cout)
        self.weights1 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))
        self.weights2 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))

    def forward(self, x):
        B, _, H, W = x.shape
        x_ft = torch.fft.rfft2(x)
        out = torch.zeros(B, self.cout, H, W // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, :self.m1, :self.m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :self.m1, :self.m2], self.weights1)
        out[:, :, -self.m1:, :self.m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -self.m1:, :self.m2], self.weights2)
        return torch.fft.irfft2(out, s=(H, W))


class FNO2dTime(nn.Module):
    def __init__(self, t_in, modes, width):
        super().__init__()
        self.p = nn.Linear(t_in + 2, width)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes, modes) for _ in range(4))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(4))
        self.q1 = nn.Linear(width, 128)
        self.q2 = nn.Linear(128, 1)

    def forward(self, x):
        # x: (B, S, S, t_in)
        B, S1, S2, _ = x.shape
        gx = torch.linspace(0, 1, S1, device=x.device).view(1, S1, 1, 1).expand(B, S1, S2, 1)
        gy = torch.linspace(0, 1, S2, device=x.device).view(1, 1, S2, 1).expand(B, S1, S2, 1)
        h = self.p(torch.cat([x, gx, gy], dim=-1)).permute(0, 3, 1, 2)
        for k, (sc, pw) in enumerate(zip(self.spectral, self.pointwise)):
            h = sc(h) + pw(h)
            if k < 3:
                h = F.gelu(h)
        h = h.permute(0, 2, 3, 1)
        return self.q2(F.gelu(self.q1(h)))


def rel_l2_sum(pred, true):
    B = pred.shape[0]
    num = torch.linalg.norm((pred - true).reshape(B, -1), dim=1)
    den = torch.linalg.norm(true.reshape(B, -1), dim=1)
    return (num / den).sum()


def load_ns(path, ntrain, ntest, t_in, t_out):
    with h5py.File(path, "r") as f:
        u = np.array(f["u"], dtype=np.float32)  # (T, S, S, N) in MATLAB order
    u = torch.from_numpy(u).permute(3, 1, 2, 0).contiguous()  # (N, S, S, T)
    a, y = u[..., :t_in], u[..., t_in:t_in + t_out]
    return (a[:ntrain], y[:ntrain]), (a[-ntest:], y[-ntest:])


def rollout(model, xx, steps):
    preds = []
    for _ in range(steps):
        im = model(xx)
        preds.append(im)
        xx = torch.cat([xx[..., 1:], im], dim=-1)
    return torch.cat(preds, dim=-1)


def main():
    cfg = get_config()
    wandb.init(project=cfg.project, name=cfg.run_name, config=vars(cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    is_main = rank == 0
    device = torch.device("cuda", local_rank)

    (a_tr, y_tr), (a_te, y_te) = load_ns(cfg.data, cfg.ntrain, cfg.ntest, cfg.t_in, cfg.t_out)
    train_set, test_set = TensorDataset(a_tr, y_tr), TensorDataset(a_te, y_te)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_indices = list(range(rank, len(test_set), world_size))
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, test_indices), batch_size=cfg.batch_size)

    model = DDP(FNO2dTime(cfg.t_in, cfg.modes, cfg.width).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs * len(train_loader))

    ckpt_path = os.path.join(cfg.ckpt_dir, cfg.run_name, "last.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for a, y in train_loader:
            a, y = a.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = rollout(model, a, cfg.t_out)
            step_loss = sum(F.mse_loss(pred[..., t], y[..., t]) for t in range(cfg.t_out))
            optimizer.zero_grad(set_to_none=True)
            step_loss.backward()
            optimizer.step()
            scheduler.step()
            stats[0] += step_loss.detach() * a.shape[0]
            stats[1] += rel_l2_sum(pred.detach(), y)
            stats[2] += a.shape[0]

        model.eval()
        test_stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for a, y in test_loader:
                a, y = a.to(device), y.to(device)
                test_stats[0] += rel_l2_sum(rollout(model.module, a, cfg.t_out), y)
                test_stats[1] += a.shape[0]
        dist.all_reduce(stats)
        dist.all_reduce(test_stats)

        if is_main:
            metrics = {"epoch": epoch,
                       "train/mse_sum": (stats[0] / stats[2]).item(),
                       "train/rel_l2": (stats[1] / stats[2]).item(),
                       "test/rel_l2": (test_stats[0] / test_stats[1]).item(),
                       "lr": scheduler.get_last_lr()[0],
                       "epoch_time": time.time() - t0}
            wandb.log(metrics, step=epoch)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()))
            os.makedirs(os.path.dirname(ckpt_path), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    if is_main:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
