"""
SSDU: self-supervised learning via data undersampling (Yaman et al.), fastMRI multicoil knee.

The acquired (already undersampled) k-space locations Omega are split into two disjoint sets:
Theta (used in the data-consistency units) and Lambda (used only in the loss). No fully sampled
reference is needed for training.

Runs one process per GPU on a single machine:
    python 16_ssdu_selfsup_spawn.py --data /data/knee_mc_sens --gpus 4 --rho 0.4
"""
import argparse
import glob
import os
import socket
from contextlib import closing

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def fft2c(x):
    return torch.fft.fftshift(torch.fft.fft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def ifft2c(x):
    return torch.fft.fftshift(torch.fft.ifft2(torch.fft.ifftshift(x, dim=(-2, -1)), norm="ortho"), dim=(-2, -1))


def uniform_mask(ny, accel, acs):
    m = np.zeros(ny, np.float32)
    m[::accel] = 1
    m[ny // 2 - acs // 2: ny // 2 + acs // 2] = 1
    return m


def ssdu_split(omega, rho, acs_box, rng):
    """Gaussian-weighted selection of Lambda (loss) points from Omega, centre kept in Theta."""
    nx, ny = omega.shape
    cx, cy = nx // 2, ny // 2
    ix, iy = np.nonzero(omega)
    keep_c = (np.abs(ix - cx) < acs_box // 2) & (np.abs(iy - cy) < acs_box // 2)
    cand = np.where(~keep_c)[0]
    n_lambda = int(round(rho * len(ix)))
    w = np.exp(-(((ix[cand] - cx) / (nx / 4)) ** 2 + ((iy[cand] - cy) / (ny / 4)) ** 2))
    pick = rng.choice(cand, size=min(n_lambda, len(cand)), replace=False, p=w / w.sum())
    lam = np.zeros_like(omega)
    lam[ix[pick], iy[pick]] = 1
    return omega - lam, lam


class SSDUSlices(Dataset):
    def __init__(self, files, accel, acs, rho, train=True):
        self.items = []
        for f in files:
            with h5py.File(f, "r") as hf:
                self.items += [(f, s) for s in range(hf["kspace"].shape[0])]
        self.accel, self.acs, self.rho, self.train = accel, acs, rho, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, s = self.items[i]
        with h5py.File(f, "r") as hf:
            k = hf["kspace"][s]            # (coils, nx, ny)
            sens = hf["sens_maps"][s]
            ref = hf["reference"][s] if not self.train else np.zeros(k.shape[1:], np.complex64)
        k = k / np.abs(k).max()
        omega = np.tile(uniform_mask(k.shape[-1], self.accel, self.acs)[None], (k.shape[1], 1))
        if self.train:
            theta, lam = ssdu_split(omega, self.rho, 4 * self.acs, np.random.default_rng())
        else:
            theta, lam = omega, np.zeros_like(omega)
        t = torch.from_numpy
        return t(k * omega).to(torch.complex64), t(sens).to(torch.complex64), t(theta), t(lam), t(ref).to(torch.complex64)


class ResNetDenoiser(nn.Module):
    def __init__(self, nf=64, nb=15):
        super().__init__()
        self.head = nn.Conv2d(2, nf, 3, padding=1)
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv2d(nf, nf, 3, padding=1), nn.ReLU(True),
                                                  nn.Conv2d(nf, nf, 3, padding=1)) for _ in range(nb)])
        self.tail = nn.Conv2d(nf, 2, 3, padding=1)

    def forward(self, z):
        x = torch.view_as_real(z).permute(0, 3, 1, 2)
        h = self.head(x)
        for blk in self.body:
            h = h + 0.1 * blk(h)
        return torch.view_as_complex((x + self.tail(h)).permute(0, 2, 3, 1).contiguous())


class UnrolledSSDU(nn.Module):
    def __init__(self, iters=10, cg=10):
        super().__init__()
        self.denoiser = ResNetDenoiser()
        self.mu = nn.Parameter(torch.tensor(0.05))
        self.iters, self.cg = iters, cg

    def dc(self, z, atb, sens, mask):
        A = lambda v: (ifft2c(fft2c(sens * v[:, None]) * mask[:, None]) * sens.conj()).sum(1) + self.mu * v
        rhs = atb + self.mu * z
        x = z
        r = rhs - A(x)
        p, rr = r, (r.abs() ** 2).sum((-2, -1), keepdim=True)
        for _ in range(self.cg):
            Ap = A(p)
            a = rr / ((p.conj() * Ap).real.sum((-2, -1), keepdim=True) + 1e-12)
            x, r = x + a * p, r - a * Ap
            rr_new = (r.abs() ** 2).sum((-2, -1), keepdim=True)
            p, rr = r + (rr_new / (rr + 1e-12)) * p, rr_new
        return x

    def forward(self, k_theta, sens, theta):
        atb = (ifft2c(k_theta) * sens.conj()).sum(1)
        x = atb
        for _ in range(self.iters):
            x = self.dc(self.denoiser(x), atb, sens, theta)
        return x


def ssdu_loss(x, k, sens, lam):
    pred = fft2c(sens * x[:, None]) * lam[:, None]
    tgt = k * lam[:, None]
    diff = (pred - tgt).flatten(1)
    return diff.norm(dim=1).div(tgt.flatten(1).norm(dim=1) + 1e-12).mean() + \
        diff.abs().sum(1).div(tgt.flatten(1).abs().sum(1) + 1e-12).mean()


def train_worker(rank, world_size, cfg):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(cfg.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    dev = torch.device("cuda", rank)

    files = sorted(glob.glob(os.path.join(cfg.data, "train", "*.h5")))
    vfiles = sorted(glob.glob(os.path.join(cfg.data, "val", "*.h5")))
    ds = SSDUSlices(files, cfg.accel, cfg.acs, cfg.rho, train=True)
    vds = SSDUSlices(vfiles, cfg.accel, cfg.acs, cfg.rho, train=False)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)

    model = DDP(UnrolledSSDU().to(dev), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    os.makedirs(cfg.out, exist_ok=True)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=dev)
        for k, sens, theta, lam, _ in loader:
            k, sens, theta, lam = k.to(dev), sens.to(dev), theta.to(dev), lam.to(dev)
            x = model(k * theta[:, None], sens, theta)
            loss = ssdu_loss(x, k, sens, lam)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(run)

        model.eval()
        nmse = torch.zeros(2, device=dev)
        with torch.no_grad():
            for i in range(rank, len(vds), world_size):
                k, sens, theta, _, ref = (t[None].to(dev) for t in vds[i])
                x = model.module(k, sens, theta)
                err = (x.abs() - ref.abs()).pow(2).sum() / ref.abs().pow(2).sum()
                nmse += torch.stack([err, torch.ones((), device=dev)])
        dist.all_reduce(nmse)
        if rank == 0:
            print(f"epoch {epoch}: ssdu loss {(run[0] / run[1]).item():.4f}  val NMSE {(nmse[0] / nmse[1]).item():.5f}",
                  flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(cfg.out, f"ssdu_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--accel", type=int, default=4)
    p.add_argument("--acs", type=int, default=24)
    p.add_argument("--rho", type=float, default=0.4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="ckpt/ssdu")
    cfg = p.parse_args()
    cfg.port = free_port()
    mp.spawn(train_worker, args=(cfg, cfg.gpus), nprocs=cfg.gpus, join=True)
