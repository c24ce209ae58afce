"""DeepONet (CNN branch, MLP trunk) for 2D Darcy flow: permeability k(x) -> pressure p(x).

    torchrun --standalone --nproc_per_node=4 16_darcy_deeponet_trainer.py --cfg configs/darcy_deeponet.json
"""
import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class TrainConfig:
    train_file: str = "/data/darcy/darcy_64_train.h5"
    test_file: str = "/data/darcy/darcy_64_test.h5"
    out_dir: str = "runs/darcy_deeponet"
    latent: int = 256
    trunk_layers: list = field(default_factory=lambda: [256, 256, 256, 256])
    batch_size: int = 32
    query_points: int = 1024
    lr: float = 1e-3
    min_lr: float = 1e-5
    epochs: int = 400
    warmup_epochs: int = 5
    grad_clip: float = 1.0
    ckpt_every: int = 10
    resume: bool = True


class DarcyPointwise(Dataset):
    """Each item: a permeability field and a random subset of (x, y, p) query points."""

    def __init__(self, path, query_points=None):
        with h5py.File(path, "r") as f:
            self.k = np.log(f["k"][:].astype(np.float32))
            self.p = f["p"][:].astype(np.float32)
        n, H, W = self.p.shape
        xs, ys = np.meshgrid(np.linspace(0, 1, H, dtype=np.float32), np.linspace(0, 1, W, dtype=np.float32), indexing="ij")
        self.coords = np.stack([xs.ravel(), ys.ravel()], -1)
        self.k_mean, self.k_std = self.k.mean(), self.k.std()
        self.query_points = query_points

    def __len__(self):
        return self.p.shape[0]

    def __getitem__(self, i):
        k = (self.k[i] - self.k_mean) / self.k_std
        p = self.p[i].ravel()
        if self.query_points is not None:
            sel = np.random.choice(p.shape[0], self.query_points, replace=False)
            return torch.from_numpy(k[None]), torch.from_numpy(self.coords[sel]), torch.from_numpy(p[sel])
        return torch.from_numpy(k[None]), torch.from_numpy(self.coords), torch.from_numpy(p)


class Branch(nn.Module):
    def __init__(self, latent):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv2d(32, 64, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(128, 128, 3, stride=2, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(),
            nn.Linear(512, latent),
        )

    def forward(self, k):
        return self.net(k)


class Trunk(nn.Module):
    def __init__(self, layers, latent, n_freq=16):
        super().__init__()
        self.register_buffer("freqs", math.pi * 2.0 ** torch.arange(n_freq // 2, dtype=torch.float32))
        dims = [2 + 2 * 2 * (n_freq // 2)] + layers
        mods = []
        for a, b in zip(dims[:-1], dims[1:]):
            mods += [nn.Linear(a, b), nn.SiLU()]
        mods.append(nn.Linear(dims[-1], latent))
        self.net = nn.Sequential(*mods)

    def forward(self, y):
        proj = y[..., None] * self.freqs  # [..., 2, F]
        feats = torch.cat([y, torch.sin(proj).flatten(-2), torch.cos(proj).flatten(-2)], -1)
        return self.net(feats)


class DeepONet2d(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.branch = Branch(cfg.latent)
        self.trunk = Trunk(cfg.trunk_layers, cfg.latent)
        self.b0 = nn.Parameter(torch.zeros(()))

    def forward(self, k, y):
        return torch.einsum("bl,bnl->bn", self.branch(k), self.trunk(y)) / math.sqrt(self.branch.net[-1].out_features) + self.b0


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(1)

        self.train_ds = DarcyPointwise(cfg.train_file, cfg.query_points)
        self.test_ds = DarcyPointwise(cfg.test_file)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_ds, cfg.batch_size, sampler=self.sampler, num_workers=4,
                                 pin_memory=True, drop_last=True)
        test_idx = range(self.rank, len(self.test_ds), self.world)
        self.test_loader = DataLoader(torch.utils.data.Subset(self.test_ds, test_idx), batch_size=8)

        self.model = DDP(DeepONet2d(cfg).to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=1e-4)
        self.epoch = 0
        self.best = float("inf")
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pt")
        if cfg.resume and os.path.isfile(self.ckpt_path):
            self.load(self.ckpt_path)

    def lr_at(self, epoch):
        c = self.cfg
        if epoch < c.warmup_epochs:
            return c.lr * (epoch + 1) / c.warmup_epochs
        t = (epoch - c.warmup_epochs) / max(1, c.epochs - c.warmup_epochs)
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * t))

    def save(self, path):
        torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                    "epoch": self.epoch, "best": self.best, "cfg": asdict(self.cfg)}, path)

    def load(self, path):
        state = torch.load(path, map_location=self.device)
        self.model.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.epoch, self.best = state["epoch"] + 1, state["best"]

    def train_epoch(self):
        self.model.train()
        self.sampler.set_epoch(self.epoch)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.epoch)
        acc = torch.zeros(2, device=self.device)
        for k, y, p in self.loader:
            k, y, p = (t.to(self.device, non_blocking=True) for t in (k, y, p))
            loss = F.mse_loss(self.model(k, y), p)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    @torch.no_grad()
    def test(self):
        self.model.eval()
        acc = torch.zeros(2, device=self.device)
        for k, y, p in self.test_loader:
            k, y, p = k.to(self.device), y.to(self.device), p.to(self.device)
            pred = self.model.module(k, y)
            acc[0] += ((pred - p).norm(dim=1) / p.norm(dim=1)).sum()
            acc[1] += k.shape[0]
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    def fit(self):
        while self.epoch < self.cfg.epochs:
            t0 = time.time()
            train_loss = self.train_epoch()
            rel = self.test()
            if self.is_main:
                print(f"epoch {self.epoch:4d} lr {self.opt.param_groups[0]['lr']:.2e} train {train_loss:.4e} "
                      f"test rel-L2 {rel:.4e} ({time.time() - t0:.1f}s)", flush=True)
            if rel < self.best:
                self.best = rel
                self.save(os.path.join(self.cfg.out_dir, "best.pt"))
            if (self.epoch + 1) % self.cfg.ckpt_every == 0:
                self.save(self.ckpt_path)
            self.epoch += 1
        dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = TrainConfig()
    if a.cfg:
        with open(a.cfg) as fh:
            cfg = TrainConfig(**{**asdict(cfg), **json.load(fh)})
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
