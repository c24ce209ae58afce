#!/usr/bin/env python
"""
Physics-informed neural network for 2D incompressible flow past a cylinder
(Re=100), trained data-parallel over collocation points.

    torchrun --standalone --nproc_per_node=4 01_pinn_navier_stokes_ddp.py \
        --config configs/cylinder_re100.yaml

Each rank owns a disjoint slice of the interior collocation points; the sparse
velocity measurements (PIV snapshots) are sharded with a DistributedSampler.
Residual-based adaptive refinement (RAR) adds points where the PDE residual is
largest every few epochs.
"""
import argparse
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


@dataclass
class PINNConfig:
    data_path: str = "data/cylinder_piv_re100.npz"
    out_dir: str = "runs/pinn_cylinder"
    hidden: int = 128
    depth: int = 8
    re: float = 100.0
    n_collocation: int = 200_000      # global, split over ranks
    colloc_batch: int = 4096          # per rank
    data_batch: int = 1024            # per rank
    epochs: int = 200
    steps_per_epoch: int = 250
    lr: float = 1e-3
    w_pde: float = 1.0
    w_data: float = 10.0
    rar_every: int = 10
    rar_candidates: int = 20_000
    rar_k: int = 512
    rar_threshold: float = 5e-3
    seed: int = 1234
    domain: tuple = (-1.0, 8.0, -2.0, 2.0, 0.0, 7.0)   # x0, x1, y0, y1, t0, t1


class PIVDataset(Dataset):
    """Sparse PIV measurements: rows of (x, y, t, u, v)."""

    def __init__(self, path):
        arr = np.load(path)["samples"].astype(np.float32)
        self.xyt = torch.from_numpy(arr[:, :3])
        self.uv = torch.from_numpy(arr[:, 3:5])

    def __len__(self):
        return self.xyt.shape[0]

    def __getitem__(self, i):
        return self.xyt[i], self.uv[i]


class FlowMLP(nn.Module):
    def __init__(self, hidden, depth):
        super().__init__()
        layers = [nn.Linear(3, hidden), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.Tanh()]
        layers.append(nn.Linear(hidden, 3))   # u, v, p
        self.net = nn.Sequential(*layers)
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, xyt):
        return self.net(xyt)


def sample_domain(n, domain, device, gen):
    x0, x1, y0, y1, t0, t1 = domain
    lo = torch.tensor([x0, y0, t0], device=device)
    hi = torch.tensor([x1, y1, t1], device=device)
    pts = lo + (hi - lo) * torch.rand(n, 3, device=device, generator=gen)
    # drop points inside the cylinder (r = 0.5 at the origin)
    keep = pts[:, 0] ** 2 + pts[:, 1] ** 2 > 0.25
    return pts[keep]


def navier_stokes_residual(out, xyt, re):
    """Momentum + continuity residuals of `out` = net(xyt); xyt must require grad."""
    u, v, p = out[:, 0:1], out[:, 1:2], out[:, 2:3]

    def d(f):
        return torch.autograd.grad(f, xyt, torch.ones_like(f), create_graph=True)[0]

    du, dv, dp = d(u), d(v), d(p)
    u_x, u_y, u_t = du[:, 0:1], du[:, 1:2], du[:, 2:3]
    v_x, v_y, v_t = dv[:, 0:1], dv[:, 1:2], dv[:, 2:3]
    u_xx, u_yy = d(u_x)[:, 0:1], d(u_y)[:, 1:2]
    v_xx, v_yy = d(v_x)[:, 0:1], d(v_y)[:, 1:2]
    f_u = u_t + u * u_x + v * u_y + dp[:, 0:1] - (u_xx + u_yy) / re
    f_v = v_t + u * v_x + v * v_y + dp[:, 1:2] - (v_xx + v_yy) / re
    div = u_x + v_y
    return torch.cat([f_u, f_v, div], dim=1)


def pinn_losses(model, colloc_pts, xyt, uv, re):
    """Single forward over collocation + measurement points."""
    n_c = colloc_pts.shape[0]
    pts = torch.cat([colloc_pts, xyt]).requires_grad_(True)
    out = model(pts)
    res = navier_stokes_residual(out[:n_c], pts, re)[:n_c]
    loss_pde = res.pow(2).mean()
    loss_data = (out[n_c:, :2] - uv).pow(2).mean()
    return loss_pde, loss_data


def refine_collocation(model, colloc, cfg, device, gen):
    """Residual-based adaptive refinement (Lu et al., 2021)."""
    cand = sample_domain(cfg.rar_candidates, cfg.domain, device, gen)
    cand.requires_grad_(True)
    res = navier_stokes_residual(model.module(cand), cand, cfg.re)
    score = res.detach().pow(2).sum(dim=1)
    if score.mean() > cfg.rar_threshold:
        new_pts = cand.detach()[score.topk(cfg.rar_k).indices]
        bucket = [torch.empty_like(new_pts) for _ in range(dist.get_world_size())]
        dist.all_gather(bucket, new_pts)
        merged = torch.cat(bucket)
        # re-shard so the hot spots found by one rank are spread over all ranks
        colloc = torch.cat([colloc, merged[dist.get_rank()::dist.get_world_size()]])
    return colloc


class InfiniteLoader:
    def __init__(self, loader, sampler):
        self.loader, self.sampler, self.epoch = loader, sampler, 0
        self.sampler.set_epoch(self.epoch)
        self.it = iter(loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


def load_config(path):
    cfg = PINNConfig()
    if path:
        with open(path) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, tuple(v) if k == "domain" else v)
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    cfg = load_config(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(cfg.seed)
    model = FlowMLP(cfg.hidden, cfg.depth).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1

    # rank-specific generator: every rank owns different collocation points
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed + 1000 * rank)
    colloc = sample_domain(cfg.n_collocation // world, cfg.domain, device, gen)

    piv = PIVDataset(cfg.data_path)
    sampler = DistributedSampler(piv, shuffle=True, seed=cfg.seed)
    loader = DataLoader(piv, batch_size=cfg.data_batch, sampler=sampler,
                        num_workers=2, pin_memory=True, drop_last=True)
    data_stream = InfiniteLoader(loader, sampler)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(asdict(cfg), f)
        print(f"[pinn] world={world} colloc/rank={colloc.shape[0]} piv={len(piv)}", flush=True)

    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(3, device=device)
        for step in range(cfg.steps_per_epoch):
            idx = torch.randint(0, colloc.shape[0], (cfg.colloc_batch,), device=device, generator=gen)
            xyt, uv = data_stream.next()
            xyt, uv = xyt.to(device, non_blocking=True), uv.to(device, non_blocking=True)
            loss_pde, loss_data = pinn_losses(model, colloc[idx], xyt, uv, cfg.re)

            loss = cfg.w_pde * loss_pde + cfg.w_data * loss_data
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), loss_pde.detach(), loss_data.detach()])

        sched.step()
        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        running /= world * cfg.steps_per_epoch

        if (epoch + 1) % cfg.rar_every == 0:
            colloc = refine_collocation(model, colloc, cfg, device, gen)

        if rank == 0:
            print(f"epoch {epoch:4d} loss {running[0]:.4e} pde {running[1]:.4e} "
                  f"data {running[2]:.4e} n_colloc {colloc.shape[0]} {time.time() - t0:.1f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(cfg.out_dir, "last.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
