"""Coarse-to-fine NeRF trainer (Blender / NSVF synthetic), torchrun + DDP.

The coarse network is trained alone for the first `fine_start` iterations, then the
importance-sampled fine network is added.

    torchrun --nproc_per_node=4 12_nerf_coarse_fine.py --root data/nerf_synthetic/drums --workdir work/drums
"""
import argparse
import json
import logging
import math
import os
from dataclasses import MISSING, dataclass

import imageio.v2 as imageio
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)


@dataclass
class Config:
    root: str
    workdir: str
    iters: int = 150_000
    batch: int = 4096
    n_coarse: int = 64
    n_fine: int = 128
    fine_start: int = 2000
    lr: float = 5e-4
    decay_steps: int = 250_000
    near: float = 2.0
    far: float = 6.0
    eval_interval: int = 10_000
    ckpt_interval: int = 10_000


def parse() -> Config:
    ap = argparse.ArgumentParser()
    for name, field in Config.__dataclass_fields__.items():
        if field.default is MISSING:
            ap.add_argument(f"--{name}", type=field.type, required=True)
        else:
            ap.add_argument(f"--{name}", type=type(field.default), default=field.default)
    return Config(**vars(ap.parse_args()))


class Frames:
    def __init__(self, root, split):
        meta = json.load(open(os.path.join(root, f"transforms_{split}.json")))
        ims = [imageio.imread(os.path.join(root, f["file_path"] + ".png")).astype(np.float32) / 255.0 for f in meta["frames"]]
        ims = np.stack(ims)
        self.rgb = torch.from_numpy(ims[..., :3] * ims[..., 3:] + 1.0 - ims[..., 3:])
        self.c2w = torch.from_numpy(np.stack([np.array(f["transform_matrix"], np.float32) for f in meta["frames"]]))
        self.H, self.W = self.rgb.shape[1:3]
        self.focal = 0.5 * self.W / math.tan(0.5 * meta["camera_angle_x"])

    def rays(self, idx):
        j, i = torch.meshgrid(torch.arange(self.H, dtype=torch.float32), torch.arange(self.W, dtype=torch.float32), indexing="ij")
        d = torch.stack([(i - self.W / 2) / self.focal, -(j - self.H / 2) / self.focal, -torch.ones_like(i)], -1)
        d = d @ self.c2w[idx, :3, :3].T
        return self.c2w[idx, :3, 3].expand_as(d), d


def posenc(x, L):
    freq = 2.0 ** torch.arange(L, device=x.device, dtype=x.dtype)
    xb = (x[..., None, :] * freq[:, None]).flatten(-2)
    return torch.cat([x, torch.sin(xb), torch.cos(xb)], -1)


class Field(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.l1 = nn.ModuleList([nn.Linear(63, width)] + [nn.Linear(width, width) for _ in range(4)])
        self.l2 = nn.ModuleList([nn.Linear(width + 63, width)] + [nn.Linear(width, width) for _ in range(2)])
        self.out_sigma = nn.Linear(width, 1)
        self.bottleneck = nn.Linear(width, width)
        self.view = nn.Linear(width + 27, width // 2)
        self.out_rgb = nn.Linear(width // 2, 3)

    def forward(self, x, d):
        e = posenc(x, 10)
        h = e
        for l in self.l1:
            h = F.relu(l(h))
        h = torch.cat([h, e], -1)
        for l in self.l2:
            h = F.relu(l(h))
        sigma = F.relu(self.out_sigma(h)).squeeze(-1)
        v = F.relu(self.view(torch.cat([self.bottleneck(h), posenc(d, 4)], -1)))
        return torch.sigmoid(self.out_rgb(v)), sigma


def integrate(field, o, d, z):
    p = o[:, None] + d[:, None] * z[..., None]
    rgb, sigma = field(p, F.normalize(d, dim=-1)[:, None].expand_as(p))
    delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1) * d.norm(dim=-1, keepdim=True)
    a = 1 - torch.exp(-sigma * delta)
    w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
    return (w[..., None] * rgb).sum(1) + (1 - w.sum(-1, keepdim=True)), w


class CoarseFineNeRF(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.coarse = Field()
        self.fine = Field()

    def forward(self, o, d, use_fine=True, randomized=True):
        cfg = self.cfg
        z = torch.linspace(cfg.near, cfg.far, cfg.n_coarse, device=o.device).expand(o.shape[0], -1)
        if randomized:
            z = z + (torch.rand_like(z) - 0.5) * (cfg.far - cfg.near) / cfg.n_coarse
        rgb_c, w = integrate(self.coarse, o, d, z)
        if not use_fine:
            return rgb_c, None
        with torch.no_grad():
            mids = 0.5 * (z[:, 1:] + z[:, :-1])
            pdf = w[:, 1:-1] + 1e-5
            pdf = pdf / pdf.sum(-1, keepdim=True)
            cdf = F.pad(torch.cumsum(pdf, -1), (1, 0))
            u = torch.rand(o.shape[0], cfg.n_fine, device=o.device) if randomized else \
                torch.linspace(0, 1, cfg.n_fine, device=o.device).expand(o.shape[0], -1).contiguous()
            k = torch.searchsorted(cdf, u, right=True).clamp(1, cdf.shape[1] - 1)
            c0, c1, b0, b1 = cdf.gather(1, k - 1), cdf.gather(1, k), mids.gather(1, k - 1), mids.gather(1, k)
            zf = b0 + (u - c0) / (c1 - c0).clamp_min(1e-5) * (b1 - b0)
            z_all, _ = torch.sort(torch.cat([z, zf], -1), -1)
        rgb_f, _ = integrate(self.fine, o, d, z_all)
        return rgb_c, rgb_f


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.ERROR, format="[%(asctime)s] %(message)s")

        train = Frames(cfg.root, "train")
        o, d = zip(*[train.rays(i) for i in range(len(train.c2w))])
        self.rays_o = torch.stack(o).view(-1, 3).to(self.device)
        self.rays_d = torch.stack(d).view(-1, 3).to(self.device)
        self.target = train.rgb.view(-1, 3).to(self.device)
        self.test = Frames(cfg.root, "test")

        self.net = CoarseFineNeRF(cfg).to(self.device)
        self.model = DDP(self.net, device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 0.1 ** (s / cfg.decay_steps))
        self.writer = SummaryWriter(cfg.workdir) if self.rank == 0 else None
        self.gen = torch.Generator(device=self.device).manual_seed(7 + self.rank)
        self.step = 0
        ck = os.path.join(cfg.workdir, "last.ckpt")
        if os.path.exists(ck):
            state = torch.load(ck, map_location=self.device)
            self.net.load_state_dict(state["net"])
            self.opt.load_state_dict(state["opt"])
            self.sched.load_state_dict(state["sched"])
            self.step = state["step"]
            logger.info("resumed at step %d", self.step)

    def train_step(self):
        n = self.cfg.batch // self.world
        idx = torch.randint(0, self.rays_o.shape[0], (n,), device=self.device, generator=self.gen)
        use_fine = self.step >= self.cfg.fine_start
        rgb_c, rgb_f = self.model(self.rays_o[idx], self.rays_d[idx], use_fine=use_fine)
        gt = self.target[idx]
        loss = F.mse_loss(rgb_c, gt)
        if rgb_f is not None:
            loss = loss + F.mse_loss(rgb_f, gt)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self):
        self.net.eval()
        s = torch.zeros(2, device=self.device)
        for i in range(self.rank, len(self.test.c2w), self.world):
            o, d = self.test.rays(i)
            o, d = o.reshape(-1, 3).to(self.device), d.reshape(-1, 3).to(self.device)
            img = torch.cat([self.net(o[k:k + 8192], d[k:k + 8192], randomized=False)[1] for k in range(0, o.shape[0], 8192)])
            s[0] += -10 * torch.log10(F.mse_loss(img.view_as(self.test.rgb[i]), self.test.rgb[i].to(self.device)))
            s[1] += 1
        dist.all_reduce(s)
        self.net.train()
        return (s[0] / s[1]).item()

    def save(self):
        if self.rank == 0:
            os.makedirs(self.cfg.workdir, exist_ok=True)
            tmp = os.path.join(self.cfg.workdir, "last.ckpt.tmp")
            torch.save({"net": self.net.state_dict(), "opt": self.opt.state_dict(),
                        "sched": self.sched.state_dict(), "step": self.step}, tmp)
            os.replace(tmp, os.path.join(self.cfg.workdir, "last.ckpt"))
        dist.barrier()

    def fit(self):
        while self.step < self.cfg.iters:
            loss = self.train_step()
            self.step += 1
            if self.step % 100 == 0:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if self.writer:
                    self.writer.add_scalar("loss", loss.item(), self.step)
            if self.step % self.cfg.eval_interval == 0:
                psnr = self.evaluate()
                logger.info("step %d test PSNR %.2f", self.step, psnr)
                if self.writer:
                    self.writer.add_scalar("test_psnr", psnr, self.step)
            if self.step % self.cfg.ckpt_interval == 0:
                self.save()
        if self.writer:
            self.writer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(parse()).fit()
