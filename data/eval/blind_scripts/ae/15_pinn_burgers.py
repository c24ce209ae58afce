"""Physics-informed NN for the viscous Burgers equation (Raissi et al. 2019 setup),
data-parallel over collocation points.

    u_t + u u_x - (0.01 / pi) u_xx = 0,  x in [-1, 1], t in [0, 1]

    torchrun --nproc_per_node=4 15_pinn_burgers.py --mat data/burgers_shock.mat --n-f 40000
"""
import argparse
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
from pyDOE import lhs
from torch.nn.parallel import DistributedDataParallel as DDP

NU = 0.01 / np.pi


class BurgersData:
    """Initial/boundary observations and Latin-hypercube collocation points."""

    def __init__(self, mat_path, n_u, n_f, seed=0, shard=(0, 1), device="cuda"):
        data = scipy.io.loadmat(mat_path)
        t = data["t"].flatten()[:, None]
        x = data["x"].flatten()[:, None]
        exact = np.real(data["usol"]).T
        X, T = np.meshgrid(x, t)
        self.X_star = np.hstack([X.flatten()[:, None], T.flatten()[:, None]])
        self.u_star = exact.flatten()[:, None]
        self.lb, self.ub = self.X_star.min(0), self.X_star.max(0)

        # initial condition (t = 0) and the two boundaries (x = -1, x = 1)
        xx1 = np.hstack([X[0:1, :].T, T[0:1, :].T]);    uu1 = exact[0:1, :].T
        xx2 = np.hstack([X[:, 0:1], T[:, 0:1]]);        uu2 = exact[:, 0:1]
        xx3 = np.hstack([X[:, -1:], T[:, -1:]]);        uu3 = exact[:, -1:]
        X_u = np.vstack([xx1, xx2, xx3])
        u = np.vstack([uu1, uu2, uu3])
        rng = np.random.default_rng(seed)            # same observations on every rank
        pick = rng.choice(X_u.shape[0], n_u, replace=False)

        rank, world = shard                           # collocation points split over ranks
        np.random.seed(seed + 1000 * rank)
        X_f = self.lb + (self.ub - self.lb) * lhs(2, n_f // world)
        X_f = np.vstack([X_f, X_u[pick]])

        f32 = dict(dtype=torch.float32, device=device)
        self.x_u = torch.tensor(X_u[pick], **f32)
        self.u = torch.tensor(u[pick], **f32)
        self.x_f = torch.tensor(X_f, **f32)
        self.lb_t = torch.tensor(self.lb, **f32)
        self.ub_t = torch.tensor(self.ub, **f32)


class PINN(nn.Module):
    def __init__(self, layers, lb, ub):
        super().__init__()
        self.register_buffer("lb", lb.clone().cpu())
        self.register_buffer("ub", ub.clone().cpu())
        mods = []
        for i in range(len(layers) - 2):
            mods += [nn.Linear(layers[i], layers[i + 1]), nn.Tanh()]
        mods.append(nn.Linear(layers[-2], layers[-1]))
        self.net = nn.Sequential(*mods)
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, xt):
        return self.net(2.0 * (xt - self.lb) / (self.ub - self.lb) - 1.0)


def residual(model, xt):
    xt = xt.clone().requires_grad_(True)
    u = model(xt)
    g = torch.autograd.grad(u, xt, torch.ones_like(u), create_graph=True)[0]
    u_x, u_t = g[:, 0:1], g[:, 1:2]
    u_xx = torch.autograd.grad(u_x, xt, torch.ones_like(u_x), create_graph=True)[0][:, 0:1]
    return u_t + u * u_x - NU * u_xx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mat", default="data/burgers_shock.mat")
    ap.add_argument("--n-u", type=int, default=100)
    ap.add_argument("--n-f", type=int, default=40000)
    ap.add_argument("--layers", type=str, default="2,20,20,20,20,20,20,20,20,1")
    ap.add_argument("--adam-iters", type=int, default=20000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--ckpt", default="runs/burgers/pinn.pt")
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")

    data = BurgersData(args.mat, args.n_u, args.n_f, seed=1234, shard=(rank, world))
    layers = [int(v) for v in args.layers.split(",")]

    torch.manual_seed(1234)
    model = PINN(layers, data.lb_t, data.ub_t).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5000, gamma=0.5)

    X_star = torch.tensor(data.X_star, dtype=torch.float32, device=device)
    u_star = torch.tensor(data.u_star, dtype=torch.float32, device=device)

    t0 = time.time()
    for it in range(1, args.adam_iters + 1):
        model.train()
        u_pred = model(data.x_u)
        f_pred = residual(model, data.x_f)
        loss_u = torch.mean((data.u - u_pred) ** 2)
        loss_f = torch.mean(f_pred ** 2)
        loss = loss_u + loss_f
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

        if it % args.log_every == 0:
            stats = torch.stack([loss_u.detach(), loss_f.detach()])
            dist.all_reduce(stats)
            stats /= world
            if rank == 0:
                with torch.no_grad():
                    u_hat = model.module(X_star)
                    rel_l2 = (torch.norm(u_hat - u_star) / torch.norm(u_star)).item()
                print(f"it {it:6d} loss_u {stats[0]:.3e} loss_f {stats[1]:.3e} "
                      f"rel L2 {rel_l2:.3e} ({time.time() - t0:.0f}s)", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
        torch.save({"model": model.module.state_dict(), "layers": layers,
                    "lb": data.lb, "ub": data.ub}, args.ckpt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
