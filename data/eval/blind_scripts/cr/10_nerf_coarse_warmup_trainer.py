"""NeRF trainer (coarse + fine) for DTU-style scenes, DDP.

Config is an OmegaConf YAML; any key can be overridden on the command line:

    torchrun --nproc_per_node=4 nerf_trainer.py configs/dtu_scan65.yaml train.max_steps=200000
"""
import math
import os
import sys
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def load_dtu(root, scan, downscale):
    cams = np.load(os.path.join(root, scan, "cameras.npz"))
    img_dir = os.path.join(root, scan, "image")
    names = sorted(os.listdir(img_dir))
    imgs, c2ws, Ks = [], [], []
    for i, n in enumerate(names):
        im = cv2.imread(os.path.join(img_dir, n))[..., ::-1].astype(np.float32) / 255.0
        im = cv2.resize(im, None, fx=1 / downscale, fy=1 / downscale, interpolation=cv2.INTER_AREA)
        P = (cams[f"world_mat_{i}"] @ cams[f"scale_mat_{i}"])[:3, :4]
        K, R, t = cv2.decomposeProjectionMatrix(P)[:3]
        K = K / K[2, 2]
        K[:2] /= downscale
        c2w = np.eye(4, dtype=np.float32)
        c2w[:3, :3] = R.T
        c2w[:3, 3] = (t[:3] / t[3])[:, 0]
        imgs.append(im)
        c2ws.append(c2w)
        Ks.append(K.astype(np.float32))
    return torch.from_numpy(np.stack(imgs)), torch.from_numpy(np.stack(c2ws)), torch.from_numpy(np.stack(Ks))


def make_rays(c2w, K, xs, ys):
    d = torch.stack([(xs - K[..., 0, 2]) / K[..., 0, 0], (ys - K[..., 1, 2]) / K[..., 1, 1], torch.ones_like(xs)], -1)
    rd = (c2w[..., :3, :3] @ d[..., None]).squeeze(-1)
    return c2w[..., :3, 3].expand_as(rd), F.normalize(rd, dim=-1)


def near_far_sphere(ro, rd, r=1.0):
    b = (ro * rd).sum(-1)
    c = (ro * ro).sum(-1) - r * r
    disc = (b * b - c).clamp_min(1e-6).sqrt()
    return (-b - disc).clamp_min(0.05)[:, None], (-b + disc)[:, None]


class Embed(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        out = [x]
        for k in range(self.n):
            out += [torch.sin(x * 2 ** k), torch.cos(x * 2 ** k)]
        return torch.cat(out, -1)


class MLP(nn.Module):
    def __init__(self, width=256, depth=8, skip=4):
        super().__init__()
        self.ex, self.ed = Embed(10), Embed(4)
        self.skip = skip
        dims = [63] + [width] * depth
        self.layers = nn.ModuleList(
            nn.Linear(dims[i] + (63 if i == skip else 0), dims[i + 1]) for i in range(depth))
        self.out_sigma = nn.Linear(width, 1)
        self.out_feat = nn.Linear(width, width)
        self.out_rgb = nn.Sequential(nn.Linear(width + 27, width // 2), nn.ReLU(), nn.Linear(width // 2, 3))

    def forward(self, x, d):
        e = self.ex(x)
        h = e
        for i, l in enumerate(self.layers):
            if i == self.skip:
                h = torch.cat([h, e], -1)
            h = F.relu(l(h))
        dd = self.ed(d)[:, None].expand(-1, x.shape[1], -1)
        rgb = torch.sigmoid(self.out_rgb(torch.cat([self.out_feat(h), dd], -1)))
        return rgb, F.relu(self.out_sigma(h)[..., 0])


def composite(rgb, sigma, z, bg):
    delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e10)], -1)
    a = 1 - torch.exp(-sigma * delta)
    w = a * torch.cumprod(torch.cat([torch.ones_like(a[:, :1]), 1 - a + 1e-10], -1), -1)[:, :-1]
    return (w[..., None] * rgb).sum(1) + bg * (1 - w.sum(-1, keepdim=True)), w


class HierarchicalNeRF(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.coarse = MLP(cfg.width, cfg.depth)
        self.fine = MLP(cfg.width, cfg.depth)
        self.n_c, self.n_f = cfg.n_coarse, cfg.n_fine

    def forward(self, ro, rd, bg, use_fine=True, perturb=True):
        near, far = near_far_sphere(ro, rd)
        u = torch.linspace(0, 1, self.n_c, device=ro.device)
        z = near + (far - near) * u
        if perturb:
            z = z + torch.rand_like(z) * (far - near) / self.n_c
        rgb_c, w = composite(*self.coarse(ro[:, None] + rd[:, None] * z[..., None], rd), z, bg)
        out = {"rgb_coarse": rgb_c}
        if not use_fine:
            return out
        with torch.no_grad():
            pdf = (w[:, :-1] + 1e-5) / (w[:, :-1] + 1e-5).sum(-1, keepdim=True)
            cdf = F.pad(pdf.cumsum(-1), (1, 0))
            uu = torch.rand(ro.shape[0], self.n_f, device=ro.device) if perturb else \
                torch.linspace(0, 1, self.n_f, device=ro.device).expand(ro.shape[0], -1).contiguous()
            i = torch.searchsorted(cdf, uu.contiguous(), right=True).clamp(1, cdf.shape[1] - 1)
            lo, hi = z.gather(1, i - 1), z.gather(1, i)
            c0, c1 = cdf.gather(1, i - 1), cdf.gather(1, i)
            zf = lo + (uu - c0) / (c1 - c0).clamp_min(1e-5) * (hi - lo)
            zall = torch.sort(torch.cat([z, zf], -1), -1).values
        out["rgb_fine"], _ = composite(*self.fine(ro[:, None] + rd[:, None] * zall[..., None], rd), zall, bg)
        return out


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(cfg.seed)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed * 31 + self.rank)

        imgs, c2ws, Ks = load_dtu(cfg.data.root, cfg.data.scan, cfg.data.downscale)
        test = set(cfg.data.test_views)
        tr = [i for i in range(len(imgs)) if i not in test]
        self.train = [t[tr].to(self.device) for t in (imgs, c2ws, Ks)]
        self.test = [t[sorted(test)] for t in (imgs, c2ws, Ks)]

        self.model = DDP(HierarchicalNeRF(cfg.model).to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.train.lr)
        self.step = 0
        self.out_dir = os.path.join(cfg.out_root, cfg.name)
        self.writer = None
        if self.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)
            OmegaConf.save(cfg, os.path.join(self.out_dir, "config.yaml"))
            self.writer = SummaryWriter(self.out_dir)

    def sample_batch(self):
        imgs, c2ws, Ks = self.train
        n = self.cfg.train.rays // self.world
        i = torch.randint(0, imgs.shape[0], (n,), device=self.device, generator=self.gen)
        y = torch.randint(0, imgs.shape[1], (n,), device=self.device, generator=self.gen)
        x = torch.randint(0, imgs.shape[2], (n,), device=self.device, generator=self.gen)
        ro, rd = make_rays(c2ws[i], Ks[i], x.float() + 0.5, y.float() + 0.5)
        return ro, rd, imgs[i, y, x]

    def lr(self):
        c = self.cfg.train
        return c.lr * (0.1 ** (self.step / c.max_steps))

    def train_step(self):
        ro, rd, target = self.sample_batch()
        use_fine = self.step >= self.cfg.train.get("coarse_only_steps", 2000)
        out = self.model(ro, rd, 0.0, use_fine=use_fine)
        loss = F.mse_loss(out["rgb_coarse"], target)
        if use_fine:
            loss = loss + F.mse_loss(out["rgb_fine"], target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        for g in self.opt.param_groups:
            g["lr"] = self.lr()
        self.opt.step()
        return loss.detach()

    @torch.no_grad()
    def validate(self):
        """Each rank renders its share of the held-out views; PSNR sums are reduced."""
        net = self.model.module
        net.eval()
        imgs, c2ws, Ks = self.test
        H, W = imgs.shape[1:3]
        acc = torch.zeros(2, device=self.device)
        ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
        xs, ys = xs.reshape(-1).float().to(self.device) + 0.5, ys.reshape(-1).float().to(self.device) + 0.5
        for k in range(self.rank, imgs.shape[0], self.world):
            c2w, K = c2ws[k].to(self.device), Ks[k].to(self.device)
            ro, rd = make_rays(c2w.expand(H * W, 4, 4), K.expand(H * W, 3, 3), xs, ys)
            pred = torch.cat([net(ro[s:s + 4096], rd[s:s + 4096], 0.0, perturb=False)["rgb_fine"]
                              for s in range(0, H * W, 4096)]).view(H, W, 3)
            acc[0] += -10 * torch.log10(F.mse_loss(pred, imgs[k].to(self.device)))
            acc[1] += 1
            if self.rank == 0 and k == 0:
                cv2.imwrite(os.path.join(self.out_dir, f"val_{self.step:07d}.png"),
                            (pred.cpu().numpy()[..., ::-1] * 255).clip(0, 255).astype(np.uint8))
        dist.all_reduce(acc)
        net.train()
        return (acc[0] / acc[1].clamp_min(1)).item()

    def save(self):
        if self.rank == 0:
            torch.save({"step": self.step, "model": self.model.module.state_dict(), "opt": self.opt.state_dict()},
                       os.path.join(self.out_dir, "latest.ckpt"))

    def fit(self):
        c = self.cfg.train
        t0 = time.time()
        while self.step < c.max_steps:
            loss = self.train_step()
            self.step += 1
            if self.step % c.log_every == 0:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                if self.writer:
                    self.writer.add_scalar("loss", loss.item(), self.step)
                    self.writer.add_scalar("lr", self.lr(), self.step)
                    print(f"step {self.step} loss {loss.item():.5f} {time.time() - t0:.0f}s", flush=True)
            if self.step % c.val_every == 0:
                psnr = self.validate()
                if self.writer:
                    self.writer.add_scalar("val/psnr", psnr, self.step)
            if self.step % c.save_every == 0:
                self.save()
        self.save()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    base = OmegaConf.load(sys.argv[1])
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(sys.argv[2:]))
    Trainer(cfg).fit()
