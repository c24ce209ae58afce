"""Physics-informed neural network for the 2D cylinder wake (Re=100), inferring
velocity, pressure and the unknown coefficients lambda1, lambda2 of the
Navier-Stokes equations from scattered velocity measurements.

Data: cylinder_nektar_wake.mat (Raissi et al.).

    torchrun --nproc_per_node=4 08_pinn_cylinder_wake.py --iters 200000
"""
import argparse
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--data", default="/home/shared/pinn/data/cylinder_nektar_wake.mat")
    p.add_argument("--n-obs", type=int, default=5000, help="number of scattered measurements")
    p.add_argument("--n-colloc", type=int, default=20000, help="collocation points per rank per step")
    p.add_argument("--obs-batch", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--iters", type=int, default=200000)
    p.add_argument("--w-pde", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--ckpt", default="/home/shared/pinn/runs/cylinder/pinn.pt")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class MLP(nn.Module):
    def __init__(self, width, depth, lb, ub):
        super().__init__()
        self.register_buffer("lb", torch.as_tensor(lb, dtype=torch.float32))
        self.register_buffer("ub", torch.as_tensor(ub, dtype=torch.float32))
        layers = [nn.Linear(3, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers += [nn.Linear(width, 2)]
        self.net = nn.Sequential(*layers)
        # unknown PDE coefficients
        self.lambda1 = nn.Parameter(torch.zeros(()))
        self.lambda2 = nn.Parameter(torch.zeros(()))
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, xyt):
        h = 2.0 * (xyt - self.lb) / (self.ub - self.lb) - 1.0
        return self.net(h), self.lambda1, self.lambda2


def grad(out, inp):
    return torch.autograd.grad(out, inp, grad_outputs=torch.ones_like(out), create_graph=True)[0]


def ns_residual(model, xyt):
    xyt = xyt.requires_grad_(True)
    out, l1, l2 = model(xyt)
    psi, p = out[:, 0:1], out[:, 1:2]
    d_psi = grad(psi, xyt)
    u, v = d_psi[:, 1:2], -d_psi[:, 0:1]
    du, dv, dp = grad(u, xyt), grad(v, xyt), grad(p, xyt)
    u_x, u_y, u_t = du[:, 0:1], du[:, 1:2], du[:, 2:3]
    v_x, v_y, v_t = dv[:, 0:1], dv[:, 1:2], dv[:, 2:3]
    u_xx, u_yy = grad(u_x, xyt)[:, 0:1], grad(u_y, xyt)[:, 1:2]
    v_xx, v_yy = grad(v_x, xyt)[:, 0:1], grad(v_y, xyt)[:, 1:2]
    f_u = u_t + l1 * (u * u_x + v * u_y) + dp[:, 0:1] - l2 * (u_xx + u_yy)
    f_v = v_t + l1 * (u * v_x + v * v_y) + dp[:, 1:2] - l2 * (v_xx + v_yy)
    return u, v, f_u, f_v


def load_wake(path):
    d = scipy.io.loadmat(path)
    U = d["U_star"]  # N x 2 x T
    t = d["t"]  # T x 1
    X = d["X_star"]  # N x 2
    N, T = X.shape[0], t.shape[0]
    XX = np.tile(X[:, 0:1], (1, T))
    YY = np.tile(X[:, 1:2], (1, T))
    TT = np.tile(t, (1, N)).T
    xyt = np.stack([XX.flatten(), YY.flatten(), TT.flatten()], axis=1)
    uv = np.stack([U[:, 0, :].flatten(), U[:, 1, :].flatten()], axis=1)
    return xyt.astype(np.float32), uv.astype(np.float32), d["p_star"].astype(np.float32)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    xyt, uv, _ = load_wake(args.data)
    lb, ub = xyt.min(0), xyt.max(0)
    # same measurement subset on every rank
    rng = np.random.default_rng(args.seed)
    obs = rng.choice(xyt.shape[0], args.n_obs, replace=False)
    obs_ds = TensorDataset(torch.from_numpy(xyt[obs]), torch.from_numpy(uv[obs]))
    obs_sampler = DistributedSampler(obs_ds, shuffle=True, seed=args.seed, drop_last=True)
    obs_loader = DataLoader(obs_ds, batch_size=args.obs_batch // world, sampler=obs_sampler, drop_last=True)

    # collocation points are drawn independently on each rank
    gen = torch.Generator(device=device).manual_seed(args.seed + rank)
    lb_t, ub_t = torch.as_tensor(lb, device=device), torch.as_tensor(ub, device=device)

    model = MLP(args.width, args.layers, lb, ub).to(device)
    model = DDP(model, device_ids=[args.local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)

    epoch, it, t0 = 0, 0, time.time()
    obs_sampler.set_epoch(epoch)
    obs_iter = iter(obs_loader)
    while it < args.iters:
        try:
            xb, uvb = next(obs_iter)
        except StopIteration:
            epoch += 1
            obs_sampler.set_epoch(epoch)
            obs_iter = iter(obs_loader)
            xb, uvb = next(obs_iter)
        xb, uvb = xb.to(device), uvb.to(device)
        xc = lb_t + (ub_t - lb_t) * torch.rand(args.n_colloc // world, 3, device=device, generator=gen)

        x_all = torch.cat([xb, xc], dim=0)
        u, v, f_u, f_v = ns_residual(model, x_all)
        nb = xb.shape[0]
        loss_data = ((u[:nb] - uvb[:, 0:1]) ** 2).mean() + ((v[:nb] - uvb[:, 1:2]) ** 2).mean()
        loss_pde = (f_u ** 2).mean() + (f_v ** 2).mean()
        loss = loss_data + args.w_pde * loss_pde

        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        it += 1
        if it % 10000 == 0:
            sched.step()

        if it % args.log_every == 0:
            stats = torch.stack([loss_data.detach(), loss_pde.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                l1, l2 = model.module.lambda1.item(), model.module.lambda2.item()
                print(f"it {it:7d} data {stats[0]:.3e} pde {stats[1]:.3e} "
                      f"lambda1 {l1:.4f} (1.0) lambda2 {l2:.5f} (0.01) {time.time() - t0:.0f}s", flush=True)
                t0 = time.time()

        if it % 20000 == 0 and rank == 0:
            os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "it": it,
                        "lb": lb, "ub": ub}, args.ckpt)

    if rank == 0:
        # error of the velocity field over every snapshot
        net = model.module.eval()
        errs = []
        for chunk in np.array_split(np.arange(xyt.shape[0]), 200):
            xq = torch.from_numpy(xyt[chunk]).to(device)
            u, v, _, _ = ns_residual(net, xq)
            pred = torch.cat([u, v], 1).detach().cpu().numpy()
            errs.append(((pred - uv[chunk]) ** 2).sum(0))
        ref = (uv ** 2).sum(0)
        rel = np.sqrt(np.sum(errs, 0) / ref)
        print(f"relative L2 error u {rel[0]:.3e} v {rel[1]:.3e}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
