"""NeRF in the Wild on Phototourism scenes, data parallel.

Rays are pre-extracted per image (scripts/prepare_phototourism.py) into
<root>/cache/<image_id>.npz with `rays` (HW, 8: o, d, near, far) and `rgbs` (HW, 3).
Each rank keeps only its share of the training images in memory.

    torchrun --nproc_per_node=8 nerfw_train.py --root data/brandenburg_gate --exp bg_nerfw
"""
import argparse
import csv
import logging
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)


def get_opts():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--exp", default="nerfw")
    p.add_argument("--log_dir", default="runs")
    p.add_argument("--steps", type=int, default=300000)
    p.add_argument("--batch", type=int, default=8192, help="total rays per step")
    p.add_argument("--n_samples", type=int, default=64)
    p.add_argument("--a_dim", type=int, default=48)
    p.add_argument("--t_dim", type=int, default=16)
    p.add_argument("--beta_min", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--val_every", type=int, default=10000)
    return p.parse_args()


def read_split(root):
    """Image ids for train / test from the scene's .tsv (filename, id, split, dataset)."""
    tsv = [f for f in os.listdir(root) if f.endswith(".tsv")][0]
    train, test = [], []
    with open(os.path.join(root, tsv)) as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if row["id"] == "" or row["id"] == "nan":
                continue
            (train if row["split"] == "train" else test).append(int(float(row["id"])))
    return sorted(train), sorted(test)


def load_rays(root, image_ids):
    rays, rgbs, ts = [], [], []
    for k, iid in enumerate(image_ids):
        z = np.load(os.path.join(root, "cache", f"{iid}.npz"))
        rays.append(torch.from_numpy(z["rays"]))
        rgbs.append(torch.from_numpy(z["rgbs"]))
        ts.append(torch.full((z["rays"].shape[0],), k, dtype=torch.long))
    return torch.cat(rays), torch.cat(rgbs), torch.cat(ts)


def pos_enc(x, L):
    f = 2.0 ** torch.arange(L, device=x.device)
    y = (x[..., None] * f).flatten(-2)
    return torch.cat([x, torch.sin(y), torch.cos(y)], -1)


class NeRFW(nn.Module):
    def __init__(self, n_images, a_dim=48, t_dim=16, W=256, beta_min=0.1):
        super().__init__()
        self.beta_min = beta_min
        self.embedding_a = nn.Embedding(n_images, a_dim)
        self.embedding_t = nn.Embedding(n_images, t_dim)
        self.xyz = nn.ModuleList([nn.Linear(63 if i == 0 else (W + 63 if i == 4 else W), W) for i in range(8)])
        self.sigma = nn.Linear(W, 1)
        self.feat = nn.Linear(W, W)
        self.static_rgb = nn.Sequential(nn.Linear(W + 27 + a_dim, W // 2), nn.ReLU(), nn.Linear(W // 2, 3), nn.Sigmoid())
        self.transient = nn.Sequential(nn.Linear(W + t_dim, W // 2), nn.ReLU(), nn.Linear(W // 2, W // 2), nn.ReLU(),
                                       nn.Linear(W // 2, W // 2), nn.ReLU(), nn.Linear(W // 2, W // 2), nn.ReLU())
        self.t_sigma, self.t_rgb, self.t_beta = nn.Linear(W // 2, 1), nn.Linear(W // 2, 3), nn.Linear(W // 2, 1)

    def field(self, pts, dirs, a, t=None):
        ex = pos_enc(pts, 10)
        h = ex
        for i, lin in enumerate(self.xyz):
            if i == 4:
                h = torch.cat([ex, h], -1)
            h = F.relu(lin(h))
        s_sigma = F.softplus(self.sigma(h))[..., 0]
        S = pts.shape[1]
        ed = pos_enc(dirs, 4)[:, None].expand(-1, S, -1)
        s_rgb = self.static_rgb(torch.cat([self.feat(h), ed, a[:, None].expand(-1, S, -1)], -1))
        if t is None:
            return s_rgb, s_sigma, None
        ht = self.transient(torch.cat([h, t[:, None].expand(-1, S, -1)], -1))
        return s_rgb, s_sigma, (torch.sigmoid(self.t_rgb(ht)), F.softplus(self.t_sigma(ht))[..., 0],
                                F.softplus(self.t_beta(ht))[..., 0])

    def forward(self, rays, ts, n_samples, perturb=True, use_transient=True):
        ro, rd, near, far = rays[:, :3], rays[:, 3:6], rays[:, 6:7], rays[:, 7:8]
        u = torch.linspace(0, 1, n_samples, device=rays.device)
        z = near * (1 - u) + far * u
        if perturb:
            z = z + (torch.rand_like(z) - 0.5) * (far - near) / n_samples
        pts = ro[:, None] + rd[:, None] * z[..., None]
        a = self.embedding_a(ts)
        t = self.embedding_t(ts) if use_transient else None
        s_rgb, s_sig, tr = self.field(pts, F.normalize(rd, dim=-1), a, t)
        delta = torch.cat([z[:, 1:] - z[:, :-1], 1e2 * torch.ones_like(z[:, :1])], -1)
        if tr is None:
            alpha = 1 - torch.exp(-s_sig * delta)
            w = alpha * torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
            return {"rgb": (w[..., None] * s_rgb).sum(1)}
        t_rgb, t_sig, t_beta = tr
        a_s, a_t = 1 - torch.exp(-s_sig * delta), 1 - torch.exp(-t_sig * delta)
        a_all = 1 - torch.exp(-(s_sig + t_sig) * delta)
        T = torch.cumprod(torch.cat([torch.ones_like(a_all[:, :1]), 1 - a_all + 1e-10], -1), -1)[:, :-1]
        w_s, w_t = a_s * T, a_t * T
        rgb = (w_s[..., None] * s_rgb).sum(1) + (w_t[..., None] * t_rgb).sum(1)
        beta = (w_t * t_beta).sum(1) + self.beta_min
        return {"rgb": rgb, "beta": beta, "t_sigma": t_sig}


def nerfw_loss(out, target, lambda_u=0.01):
    beta = out["beta"]
    color = ((out["rgb"] - target) ** 2).sum(-1) / (2 * beta ** 2)
    return color.mean() + (3 + torch.log(beta)).mean() + lambda_u * out["t_sigma"].mean()


def main():
    opts = get_opts()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(100 + rank)

    train_ids, test_ids = read_split(opts.root)
    my_ids = train_ids[rank::world]
    rays, rgbs, ts = load_rays(opts.root, my_ids)
    rays, rgbs, ts = rays.to(device), rgbs.to(device), ts.to(device)
    logger.info("%d train images (%d on rank 0), %d rays on rank 0", len(train_ids), len(my_ids), rays.shape[0])

    model = NeRFW(len(my_ids), opts.a_dim, opts.t_dim, beta_min=opts.beta_min).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=opts.lr, eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, opts.steps, eta_min=opts.lr * 0.01)
    writer = SummaryWriter(os.path.join(opts.log_dir, opts.exp)) if rank == 0 else None

    per_rank = opts.batch // world
    for step in range(1, opts.steps + 1):
        idx = torch.randint(0, rays.shape[0], (per_rank,), device=device, generator=gen)
        out = model(rays[idx], ts[idx], opts.n_samples)
        loss = nerfw_loss(out, rgbs[idx])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()

        if step % 100 == 0:
            with torch.no_grad():
                stats = torch.stack([loss.detach(), F.mse_loss(out["rgb"].detach(), rgbs[idx])])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if writer:
                writer.add_scalar("train/loss", stats[0].item(), step)
                writer.add_scalar("train/psnr", -10 * math.log10(stats[1].item()), step)

        if step % opts.val_every == 0:
            if rank == 0:
                net = model.module
                net.eval()
                with torch.no_grad():
                    a_mean = net.embedding_a.weight.mean(0, keepdim=True)
                    vals = []
                    for iid in test_ids[:4]:
                        z = np.load(os.path.join(opts.root, "cache", f"{iid}.npz"))
                        r = torch.from_numpy(z["rays"]).to(device)
                        gt = torch.from_numpy(z["rgbs"]).to(device)
                        pred = []
                        for s in range(0, r.shape[0], 4096):
                            rr = r[s:s + 4096]
                            ro, rd, near, far = rr[:, :3], rr[:, 3:6], rr[:, 6:7], rr[:, 7:8]
                            u = torch.linspace(0, 1, opts.n_samples, device=device)
                            zz = near * (1 - u) + far * u
                            pts = ro[:, None] + rd[:, None] * zz[..., None]
                            s_rgb, s_sig, _ = net.field(pts, F.normalize(rd, dim=-1), a_mean.expand(rr.shape[0], -1))
                            delta = torch.cat([zz[:, 1:] - zz[:, :-1], 1e2 * torch.ones_like(zz[:, :1])], -1)
                            al = 1 - torch.exp(-s_sig * delta)
                            w = al * torch.cumprod(torch.cat([torch.ones_like(al[:, :1]), 1 - al + 1e-10], -1), -1)[:, :-1]
                            pred.append((w[..., None] * s_rgb).sum(1))
                        vals.append(-10 * torch.log10(F.mse_loss(torch.cat(pred), gt)).item())
                writer.add_scalar("val/psnr_static", float(np.mean(vals)), step)
                ckpt_dir = os.path.join(opts.log_dir, opts.exp, "ckpts")
                os.makedirs(ckpt_dir, exist_ok=True)
                torch.save({"step": step, "model": net.state_dict(), "optim": optim.state_dict(),
                            "train_ids": train_ids}, os.path.join(ckpt_dir, f"step{step:07d}.pt"))
                net.train()
            dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
