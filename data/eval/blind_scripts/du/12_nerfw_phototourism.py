"""NeRF in the Wild on Phototourism (brandenburg_gate, trevi_fountain, ...).

Per-image appearance and transient embeddings, uncertainty-weighted loss.
Ray tables are produced by our preprocessing (rays_{split}.npy: o, d, rgb,
image id, near, far). Multi-GPU via DDP:

    torchrun --nproc_per_node=8 12_nerfw_phototourism.py --root /data/phototourism/brandenburg_gate \
        --exp nerfw_bg [--resume ckpts/nerfw_bg/last.ckpt]
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_opts():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--exp", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=1024, help="global")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--n_a", type=int, default=48)
    p.add_argument("--n_tau", type=int, default=16)
    p.add_argument("--beta_min", type=float, default=0.1)
    p.add_argument("--lambda_u", type=float, default=0.01)
    p.add_argument("--n_coarse", type=int, default=64)
    return p.parse_args()


class RayFile(Dataset):
    """Memory-mapped [N, 12] float32 ray table; shared by the loader workers through the page cache."""

    def __init__(self, path):
        self.path = path
        self.n = np.load(path, mmap_mode="r").shape[0]
        self.arr = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.arr is None:
            self.arr = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.arr[i], dtype=np.float32))


def embed(x, L):
    out = [x]
    for k in range(L):
        out += [torch.sin(2 ** k * x), torch.cos(2 ** k * x)]
    return torch.cat(out, -1)


class NeRFW(nn.Module):
    def __init__(self, n_images, n_a, n_tau, W=256, beta_min=0.1):
        super().__init__()
        self.emb_a = nn.Embedding(n_images, n_a)
        self.emb_t = nn.Embedding(n_images, n_tau)
        self.beta_min = beta_min
        self.xyz = nn.ModuleList([nn.Linear(63, W)] + [nn.Linear(W + (63 if i == 4 else 0), W) for i in range(1, 8)])
        self.static_sigma = nn.Linear(W, 1)
        self.xyz_final = nn.Linear(W, W)
        self.dir_a = nn.Sequential(nn.Linear(W + 27 + n_a, W // 2), nn.ReLU(True))
        self.static_rgb = nn.Sequential(nn.Linear(W // 2, 3), nn.Sigmoid())
        self.transient = nn.Sequential(nn.Linear(W + n_tau, W // 2), nn.ReLU(True),
                                       nn.Linear(W // 2, W // 2), nn.ReLU(True))
        self.t_sigma = nn.Sequential(nn.Linear(W // 2, 1), nn.Softplus())
        self.t_rgb = nn.Sequential(nn.Linear(W // 2, 3), nn.Sigmoid())
        self.t_beta = nn.Sequential(nn.Linear(W // 2, 1), nn.Softplus())

    def forward(self, rays_o, rays_d, img_id, near, far, n_samples, perturb=True, transient=True):
        t = torch.linspace(0, 1, n_samples, device=rays_o.device)
        z = near[:, None] * (1 - t) + far[:, None] * t
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (far - near)[:, None] / n_samples
        pts = rays_o[:, None] + rays_d[:, None] * z[..., None]
        ex = embed(pts, 10)
        h = ex
        for i, l in enumerate(self.xyz):
            if i == 4:
                h = torch.cat([ex, h], -1)
            h = F.relu(l(h))
        s_sigma = F.softplus(self.static_sigma(h)).squeeze(-1)
        feat = self.xyz_final(h)
        ed = embed(F.normalize(rays_d, dim=-1), 4)[:, None].expand(-1, n_samples, -1)
        a = self.emb_a(img_id)[:, None].expand(-1, n_samples, -1)
        s_rgb = self.static_rgb(self.dir_a(torch.cat([feat, ed, a], -1)))

        delta = torch.cat([z[:, 1:] - z[:, :-1], torch.full_like(z[:, :1], 1e2)], -1) * rays_d.norm(dim=-1, keepdim=True)
        if not transient:
            alpha = 1 - torch.exp(-s_sigma * delta)
            w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
            return {"rgb": (w[..., None] * s_rgb).sum(1)}

        tau = self.emb_t(img_id)[:, None].expand(-1, n_samples, -1)
        th = self.transient(torch.cat([feat, tau], -1))
        t_sigma, t_rgb, t_beta = self.t_sigma(th).squeeze(-1), self.t_rgb(th), self.t_beta(th).squeeze(-1)
        a_s = 1 - torch.exp(-s_sigma * delta)
        a_t = 1 - torch.exp(-t_sigma * delta)
        a_all = 1 - torch.exp(-(s_sigma + t_sigma) * delta)
        T = torch.cumprod(torch.cat([torch.ones_like(a_all[:, :1]), 1 - a_all + 1e-10], -1), -1)[:, :-1]
        rgb = (T[..., None] * (a_s[..., None] * s_rgb + a_t[..., None] * t_rgb)).sum(1)
        beta = (T * a_t * t_beta).sum(1) + self.beta_min
        return {"rgb": rgb, "beta": beta, "t_sigma": t_sigma}


def nerfw_loss(out, target, lambda_u):
    beta = out["beta"]
    color = ((out["rgb"] - target) ** 2 / (2 * beta[:, None] ** 2)).mean()
    logb = 3 + torch.log(beta).mean()  # +3 keeps it positive
    sigma_reg = lambda_u * out["t_sigma"].mean()
    return color + logb + sigma_reg


def main():
    opt = get_opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    ckpt_dir = os.path.join("ckpts", opt.exp)

    ds = RayFile(os.path.join(opt.root, "cache", "rays_train.npy"))
    with open(os.path.join(opt.root, "cache", "meta.json")) as f:
        n_images = json.load(f)["n_images"]
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=opt.batch_size // world, sampler=sampler, num_workers=4,
                    pin_memory=True, drop_last=True)

    model = NeRFW(n_images, opt.n_a, opt.n_tau, beta_min=opt.beta_min)
    optim = torch.optim.Adam(model.parameters(), lr=opt.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=opt.epochs, eta_min=1e-6)
    first_epoch = 0
    if opt.resume:
        ckpt = torch.load(opt.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        first_epoch = ckpt["epoch"] + 1
    model = DDP(model.to(dev), device_ids=[local_rank])
    for state in optim.state.values():
        for k, v in state.items():
            if torch.is_tensor(v):
                state[k] = v.to(dev)

    writer = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join("logs", opt.exp))

    step = first_epoch * len(dl)
    for epoch in range(first_epoch, opt.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in dl:
            batch = batch.to(dev, non_blocking=True)
            o, d, rgb = batch[:, 0:3], batch[:, 3:6], batch[:, 6:9]
            img_id, near, far = batch[:, 9].long(), batch[:, 10], batch[:, 11]
            out = model(o, d, img_id, near, far, opt.n_coarse)
            loss = nerfw_loss(out, rgb, opt.lambda_u)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            step += 1
            if step % 200 == 0:
                with torch.no_grad():
                    mse = F.mse_loss(out["rgb"], rgb)
                stats = torch.stack([loss.detach(), mse])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/psnr", -10 * math.log10(stats[1].item()), step)
        sched.step()

        if rank == 0:
            print(f"epoch {epoch} {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optim.state_dict(),
                        "scheduler": sched.state_dict()}, os.path.join(ckpt_dir, "last.ckpt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
