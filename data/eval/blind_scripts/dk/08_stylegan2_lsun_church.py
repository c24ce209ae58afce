"""StyleGAN2 on LSUN Church 256 -- DDP trainer with periodic FID-50k.

    torchrun --nproc_per_node=8 train_church.py --lmdb /data/lsun/church_outdoor_train_lmdb
"""
import argparse
import math
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy import linalg
from torch import autograd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms, utils

from calc_inception import load_patched_inception_v3
from dataset import MultiResolutionDataset
from model import Discriminator, Generator


@dataclass
class Config:
    lmdb: str
    out: str = "runs/church256"
    size: int = 256
    batch: int = 8
    iters: int = 600000
    lr: float = 0.002
    r1: float = 10.0
    d_reg_every: int = 16
    g_reg_every: int = 4
    path_regularize: float = 2.0
    path_batch_shrink: int = 2
    mixing: float = 0.9
    ema_half_life_kimg: float = 10.0
    fid_every: int = 20000
    fid_n_sample: int = 50000
    fid_batch: int = 64
    inception_stats: str = "inception_church256.npz"
    resume: str = ""


def calc_fid(sample_mean, sample_cov, real_mean, real_cov, eps=1e-6):
    cov_sqrt, _ = linalg.sqrtm(sample_cov @ real_cov, disp=False)
    if not np.isfinite(cov_sqrt).all():
        offset = np.eye(sample_cov.shape[0]) * eps
        cov_sqrt = linalg.sqrtm((sample_cov + offset) @ (real_cov + offset))
    if np.iscomplexobj(cov_sqrt):
        cov_sqrt = cov_sqrt.real
    mean_diff = sample_mean - real_mean
    return float(mean_diff @ mean_diff + np.trace(sample_cov) + np.trace(real_cov) - 2 * np.trace(cov_sqrt))


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        torch.manual_seed(0)
        g = Generator(cfg.size, 512, 8, channel_multiplier=2).to(self.device)
        d = Discriminator(cfg.size, channel_multiplier=2).to(self.device)
        self.g_ema = Generator(cfg.size, 512, 8, channel_multiplier=2).to(self.device).eval()
        self.g_ema.load_state_dict(g.state_dict())
        self.g_ema.requires_grad_(False)

        gr, dr = cfg.g_reg_every / (cfg.g_reg_every + 1), cfg.d_reg_every / (cfg.d_reg_every + 1)
        self.g_optim = torch.optim.Adam(g.parameters(), lr=cfg.lr * gr, betas=(0, 0.99 ** gr))
        self.d_optim = torch.optim.Adam(d.parameters(), lr=cfg.lr * dr, betas=(0, 0.99 ** dr))
        self.start = 0
        if cfg.resume:
            ck = torch.load(cfg.resume, map_location="cpu")
            g.load_state_dict(ck["g"])
            d.load_state_dict(ck["d"])
            self.g_ema.load_state_dict(ck["g_ema"])
            self.g_optim.load_state_dict(ck["g_optim"])
            self.d_optim.load_state_dict(ck["d_optim"])
            self.start = ck["iter"] + 1

        self.g = DDP(g, device_ids=[self.local_rank], broadcast_buffers=False)
        self.d = DDP(d, device_ids=[self.local_rank], broadcast_buffers=False)
        seed = 1234 + self.rank
        random.seed(seed)
        torch.manual_seed(seed)

        tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                 transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
        self.dataset = MultiResolutionDataset(cfg.lmdb, tf, cfg.size)
        self.sampler = DistributedSampler(self.dataset, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.dataset, batch_size=cfg.batch, sampler=self.sampler, num_workers=4,
                                 pin_memory=True, drop_last=True)

        self.inception = load_patched_inception_v3().to(self.device).eval()
        stats = np.load(cfg.inception_stats)
        self.real_mean, self.real_cov = stats["mean"], stats["cov"]
        self.writer = SummaryWriter(cfg.out) if self.rank == 0 else None
        if self.rank == 0:
            os.makedirs(os.path.join(cfg.out, "ckpt"), exist_ok=True)

    def batches(self):
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            for x in self.loader:
                yield x.to(self.device, non_blocking=True)
            epoch += 1

    def noise(self, n):
        if random.random() < self.cfg.mixing:
            return list(torch.randn(2, n, 512, device=self.device).unbind(0))
        return [torch.randn(n, 512, device=self.device)]

    @torch.no_grad()
    def fid(self):
        cfg = self.cfg
        n_local = cfg.fid_n_sample // self.world_size
        feats = []
        for start in range(0, n_local, cfg.fid_batch):
            b = min(cfg.fid_batch, n_local - start)
            img, _ = self.g_ema([torch.randn(b, 512, device=self.device)], truncation=1.0)
            feat = self.inception(img)[0].view(b, -1)
            feats.append(feat.cpu())
        feats = torch.cat(feats).numpy()
        return calc_fid(np.mean(feats, 0), np.cov(feats, rowvar=False), self.real_mean, self.real_cov)

    def train(self):
        cfg = self.cfg
        data = self.batches()
        mean_path_length = 0.0
        beta = 0.5 ** (cfg.batch * self.world_size / (cfg.ema_half_life_kimg * 1000))
        sample_z = torch.randn(25, 512, device=self.device)

        for i in range(self.start, cfg.iters):
            real = next(data)

            self.g.requires_grad_(False)
            self.d.requires_grad_(True)
            fake, _ = self.g(self.noise(cfg.batch))
            d_loss = F.softplus(self.d(fake)).mean() + F.softplus(-self.d(real)).mean()
            self.d.zero_grad(set_to_none=True)
            d_loss.backward()
            self.d_optim.step()

            if i % cfg.d_reg_every == 0:
                real.requires_grad_(True)
                real_pred = self.d(real)
                (grad,) = autograd.grad(real_pred.sum(), real, create_graph=True)
                r1 = grad.pow(2).flatten(1).sum(1).mean()
                self.d.zero_grad(set_to_none=True)
                (cfg.r1 / 2 * r1 * cfg.d_reg_every + 0 * real_pred[0]).backward()
                self.d_optim.step()

            self.g.requires_grad_(True)
            self.d.requires_grad_(False)
            fake, _ = self.g(self.noise(cfg.batch))
            g_loss = F.softplus(-self.d(fake)).mean()
            self.g.zero_grad(set_to_none=True)
            g_loss.backward()
            self.g_optim.step()

            if i % cfg.g_reg_every == 0:
                n = max(1, cfg.batch // cfg.path_batch_shrink)
                img, latents = self.g(self.noise(n), return_latents=True)
                pn = torch.randn_like(img) / math.sqrt(img.shape[2] * img.shape[3])
                (grad,) = autograd.grad((img * pn).sum(), latents, create_graph=True)
                lengths = grad.pow(2).sum(2).mean(1).sqrt()
                path_mean = mean_path_length + 0.01 * (lengths.mean() - mean_path_length)
                path_loss = (lengths - path_mean).pow(2).mean()
                mean_path_length = path_mean.detach()
                self.g.zero_grad(set_to_none=True)
                (cfg.path_regularize * cfg.g_reg_every * path_loss + 0 * img[0, 0, 0, 0]).backward()
                self.g_optim.step()

            with torch.no_grad():
                for pe, p in zip(self.g_ema.parameters(), self.g.module.parameters()):
                    pe.copy_(p.lerp(pe, beta))

            if i % 200 == 0:
                losses = torch.stack([d_loss.detach(), g_loss.detach()])
                dist.all_reduce(losses)
                losses /= self.world_size
                if self.rank == 0:
                    self.writer.add_scalar("loss/d", losses[0].item(), i)
                    self.writer.add_scalar("loss/g", losses[1].item(), i)

            if i > 0 and i % cfg.fid_every == 0:
                fid = self.fid()
                if self.rank == 0:
                    self.writer.add_scalar("fid50k", fid, i)
                    print(f"iter {i}: fid50k {fid:.3f}", flush=True)
                    with torch.no_grad():
                        sample, _ = self.g_ema([sample_z])
                    utils.save_image(sample, os.path.join(cfg.out, f"sample_{i:07d}.png"), nrow=5,
                                     normalize=True, value_range=(-1, 1))
                    torch.save({"g": self.g.module.state_dict(), "d": self.d.module.state_dict(),
                                "g_ema": self.g_ema.state_dict(), "g_optim": self.g_optim.state_dict(),
                                "d_optim": self.d_optim.state_dict(), "iter": i},
                               os.path.join(cfg.out, "ckpt", f"{i:07d}.pt"))

        if self.writer is not None:
            self.writer.close()
        dist.destroy_process_group()


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--lmdb", required=True)
    p.add_argument("--out", default="runs/church256")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=600000)
    p.add_argument("--resume", default="")
    a = p.parse_args()
    return Config(lmdb=a.lmdb, out=a.out, batch=a.batch, iters=a.iters, resume=a.resume)


if __name__ == "__main__":
    Trainer(parse()).train()
