"""Long-horizon rollout training of an FNO on 2D decaying turbulence (256^2).

The loss is accumulated over a 16-step autoregressive rollout; storing the
activations of 16 FNO applications at 256^2 does not fit in memory, so each
time step is wrapped in activation checkpointing and recomputed in backward.

    torchrun --standalone --nproc_per_node=8 17_fno_long_rollout.py --data /data/turb2d/decaying_256.h5
"""
import argparse
import logging
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="HDF5 with 'omega' [N, T, 256, 256]")
    p.add_argument("--out", default="runs/turb2d_rollout")
    p.add_argument("--n-val", type=int, default=32)
    p.add_argument("--rollout", type=int, default=16)
    p.add_argument("--modes", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--no-grad-ckpt", action="store_true")
    return p.parse_args()


class RolloutWindows(Dataset):
    def __init__(self, path, traj, horizon):
        self.path, self.horizon = path, horizon
        with h5py.File(path, "r") as f:
            self.T = f["omega"].shape[1]
            self.scale = float(f.attrs.get("omega_rms", 1.0))
        self.items = [(n, t) for n in traj for t in range(0, self.T - horizon, 2)]
        self.h5 = None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        n, t = self.items[i]
        w = self.h5["omega"][n, t:t + self.horizon + 1].astype(np.float32) / self.scale
        return torch.from_numpy(w).unsqueeze(1)  # [H+1, 1, X, Y]


class SpectralConv2d(nn.Module):
    def __init__(self, width, modes):
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(2, width, width, modes, modes, dtype=torch.cfloat) / width ** 2)

    def forward(self, x):
        m = self.modes
        xf = torch.fft.rfft2(x)
        out = torch.zeros(x.shape[0], x.shape[1], x.shape[2], x.shape[3] // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[..., :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[..., :m, :m], self.weight[0])
        out[..., -m:, :m] = torch.einsum("bixy,ioxy->boxy", xf[..., -m:, :m], self.weight[1])
        return torch.fft.irfft2(out, s=x.shape[-2:])


class FNOStepper(nn.Module):
    def __init__(self, width, modes, layers, grad_ckpt=True):
        super().__init__()
        self.grad_ckpt = grad_ckpt
        self.lift = nn.Conv2d(1, width, 1)
        self.spec = nn.ModuleList([SpectralConv2d(width, modes) for _ in range(layers)])
        self.pw = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(layers)])
        self.proj = nn.Sequential(nn.Conv2d(width, 4 * width, 1), nn.GELU(), nn.Conv2d(4 * width, 1, 1))

    def step(self, w):
        h = self.lift(w)
        for s, p in zip(self.spec, self.pw):
            h = F.gelu(s(h) + p(h))
        return w + self.proj(h)

    def forward(self, w0, n_steps):
        """Rollout of n_steps, returns [B, n_steps, 1, X, Y]."""
        w = w0
        if self.grad_ckpt and self.training:
            w = w.detach().requires_grad_(True)  # checkpointed segments need an input that requires grad
        outs = []
        for _ in range(n_steps):
            if self.grad_ckpt and self.training:
                w = checkpoint(self.step, w, use_reentrant=True)
            else:
                w = self.step(w)
            outs.append(w)
        return torch.stack(outs, dim=1)


def rollout_loss(pred, target):
    # relative L2 per step, averaged over steps and batch
    b, t = pred.shape[:2]
    num = (pred - target).reshape(b, t, -1).norm(dim=-1)
    den = target.reshape(b, t, -1).norm(dim=-1)
    return (num / den).mean()


@torch.no_grad()
def validate(net, loader, horizon, device):
    net.eval()
    acc = torch.zeros(horizon + 1, device=device, dtype=torch.float64)
    for w in loader:
        w = w.to(device)
        pred = net(w[:, 0], horizon)
        b = w.shape[0]
        err = (pred - w[:, 1:]).reshape(b, horizon, -1).norm(dim=-1) / w[:, 1:].reshape(b, horizon, -1).norm(dim=-1)
        acc[:-1] += err.sum(0).double()
        acc[-1] += b
    dist.all_reduce(acc)
    return acc[:-1] / acc[-1]


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")
    torch.manual_seed(0)

    with h5py.File(args.data, "r") as f:
        n_traj = f["omega"].shape[0]
    train_ds = RolloutWindows(args.data, range(n_traj - args.n_val), args.rollout)
    val_ds = RolloutWindows(args.data, range(n_traj - args.n_val, n_traj), args.rollout)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=args.batch_size, num_workers=2)

    net = FNOStepper(args.width, args.modes, args.layers, grad_ckpt=not args.no_grad_ckpt).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    logger.info("train windows %d, val windows %d, world %d", len(train_ds), len(val_ds), world)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for it, w in enumerate(loader):
            w = w.to(device, non_blocking=True)
            pred = model(w[:, 0], args.rollout)
            loss = rollout_loss(pred, w[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if it % 100 == 0:
                logger.info("epoch %d it %d loss %.4f peak mem %.1f GB", epoch, it, loss.item(),
                            torch.cuda.max_memory_allocated() / 2 ** 30)
        dist.all_reduce(acc)
        err = validate(net, val_loader, args.rollout, device)
        logger.info("epoch %d done %.0fs train %.4f val rel-L2 step1 %.4f step%d %.4f", epoch, time.time() - t0,
                    (acc[0] / acc[1]).item(), err[0].item(), args.rollout, err[-1].item())
        if rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "args": vars(args)}, os.path.join(args.out, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
