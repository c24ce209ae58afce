"""Data-parallel PINN for steady incompressible Navier-Stokes (Kovasznay flow, Re=20).

Each rank draws its own collocation points; gradients are averaged by DDP.

    torchrun --nproc_per_node=4 08_pinn_kovasznay.py --steps 40000 --n-interior 8192
"""
import argparse
import math
import os
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

RE = 20.0
LAM = 0.5 * RE - math.sqrt(0.25 * RE ** 2 + 4 * math.pi ** 2)
X_RANGE, Y_RANGE = (-0.5, 1.0), (-0.5, 1.5)


def exact(xy):
    x, y = xy[:, 0:1], xy[:, 1:2]
    u = 1 - torch.exp(LAM * x) * torch.cos(2 * math.pi * y)
    v = LAM / (2 * math.pi) * torch.exp(LAM * x) * torch.sin(2 * math.pi * y)
    p = 0.5 * (1 - torch.exp(2 * LAM * x))
    return torch.cat([u, v, p], dim=1)


class MLP(nn.Module):
    def __init__(self, width=128, depth=6):
        super().__init__()
        layers, d = [], 2
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.Tanh()]
            d = width
        layers.append(nn.Linear(d, 3))
        self.net = nn.Sequential(*layers)
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, xy):
        return self.net(xy)


def sample_interior(n, device, gen):
    lo = torch.tensor([X_RANGE[0], Y_RANGE[0]], device=device)
    hi = torch.tensor([X_RANGE[1], Y_RANGE[1]], device=device)
    return lo + (hi - lo) * torch.rand(n, 2, device=device, generator=gen)


def sample_boundary(n, device, gen):
    t = torch.rand(n, device=device, generator=gen)
    side = torch.randint(0, 4, (n,), device=device, generator=gen)
    x = torch.where(side < 2, X_RANGE[0] + (X_RANGE[1] - X_RANGE[0]) * t,
                    torch.where(side == 2, torch.full_like(t, X_RANGE[0]), torch.full_like(t, X_RANGE[1])))
    y = torch.where(side >= 2, Y_RANGE[0] + (Y_RANGE[1] - Y_RANGE[0]) * t,
                    torch.where(side == 0, torch.full_like(t, Y_RANGE[0]), torch.full_like(t, Y_RANGE[1])))
    return torch.stack([x, y], dim=1)


def grad(out, inp):
    return torch.autograd.grad(out, inp, torch.ones_like(out), create_graph=True)[0]


def ns_residual(model, xy):
    xy = xy.requires_grad_(True)
    uvp = model(xy)
    u, v, p = uvp[:, 0:1], uvp[:, 1:2], uvp[:, 2:3]
    du, dv, dp = grad(u, xy), grad(v, xy), grad(p, xy)
    u_x, u_y, v_x, v_y = du[:, 0:1], du[:, 1:2], dv[:, 0:1], dv[:, 1:2]
    u_xx, u_yy = grad(u_x, xy)[:, 0:1], grad(u_y, xy)[:, 1:2]
    v_xx, v_yy = grad(v_x, xy)[:, 0:1], grad(v_y, xy)[:, 1:2]
    mom_x = u * u_x + v * u_y + dp[:, 0:1] - (u_xx + u_yy) / RE
    mom_y = u * v_x + v * v_y + dp[:, 1:2] - (v_xx + v_yy) / RE
    cont = u_x + v_y
    return mom_x, mom_y, cont


@torch.no_grad()
def relative_l2(model, grid, rank, world):
    """Relative L2 error of (u, v, p) on the reference grid, sharded over ranks."""
    pts = grid[rank::world]
    pred, ref = model(pts), exact(pts)
    num = ((pred - ref) ** 2).sum(0)
    den = (ref ** 2).sum(0)
    stats = torch.cat([num, den])
    dist.all_reduce(stats)
    return (stats[:3] / stats[3:]).sqrt().tolist()


def plot_fields(model, device, path, n=201):
    xs = torch.linspace(*X_RANGE, n, device=device)
    ys = torch.linspace(*Y_RANGE, n, device=device)
    X, Y = torch.meshgrid(xs, ys, indexing="xy")
    xy = torch.stack([X.flatten(), Y.flatten()], 1)
    with torch.no_grad():
        err = (model(xy) - exact(xy)).abs().cpu().numpy()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for k, name in enumerate(["|u err|", "|v err|", "|p err|"]):
        im = axes[k].imshow(err[:, k].reshape(n, n), origin="lower",
                            extent=[*X_RANGE, *Y_RANGE], cmap="magma")
        axes[k].set_title(name)
        fig.colorbar(im, ax=axes[k])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40000)
    ap.add_argument("--n-interior", type=int, default=8192)
    ap.add_argument("--n-boundary", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bc-weight", type=float, default=10.0)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--out", default="runs/pinn_kovasznay")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    torch.manual_seed(0)  # identical init; DDP also broadcasts rank 0's weights
    model = DDP(MLP().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9 ** (1 / 2000))

    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    gx = torch.linspace(*X_RANGE, 256, device=device)
    gy = torch.linspace(*Y_RANGE, 256, device=device)
    GX, GY = torch.meshgrid(gx, gy, indexing="ij")
    ref_grid = torch.stack([GX.flatten(), GY.flatten()], 1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        xy_in = sample_interior(args.n_interior, device, gen)
        xy_bc = sample_boundary(args.n_boundary, device, gen)
        mx, my, c = ns_residual(model, xy_in)
        loss_pde = (mx ** 2).mean() + (my ** 2).mean() + (c ** 2).mean()
        loss_bc = ((model(xy_bc) - exact(xy_bc))[:, :2] ** 2).mean()
        loss = loss_pde + args.bc_weight * loss_bc

        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

        if step % args.eval_every == 0 and rank == 0:
            err_u, err_v, err_p = relative_l2(model.module, ref_grid, rank, world)
            print(f"step {step:6d} loss {loss.item():.3e} (pde {loss_pde.item():.2e} "
                  f"bc {loss_bc.item():.2e}) rel-L2 u {err_u:.2e} v {err_v:.2e} p {err_p:.2e} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "step": step,
                        "opt": opt.state_dict()}, os.path.join(args.out, "pinn.pt"))
            plot_fields(model.module, device, os.path.join(args.out, f"err_{step:06d}.png"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
