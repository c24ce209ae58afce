# Hidden-physics PINN: identify lambda_1, lambda_2 of the incompressible Navier-Stokes
# equations from scattered velocity measurements of the cylinder wake (Re=100),
# following Raissi, Perdikaris & Karniadakis (2019), trained data-parallel.
#
#   u_t + l1 (u u_x + v u_y) = -p_x + l2 (u_xx + u_yy)
#   v_t + l1 (u v_x + v v_y) = -p_y + l2 (v_xx + v_yy)
# with u = psi_y, v = -psi_x (divergence free by construction).
# True values: l1 = 1.0, l2 = 0.01.
#
#   torchrun --standalone --nproc_per_node=4 07_pinn_ns_inverse_cylinder.py \
#       --mat data/cylinder_nektar_wake.mat --n-obs 5000 --noise 0.01
import argparse
import os
import time

import numpy as np
import scipy.io
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mat", required=True)
    p.add_argument("--n-obs", type=int, default=5000)
    p.add_argument("--n-val", type=int, default=1000)
    p.add_argument("--noise", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--width", type=int, default=20)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--iters", type=int, default=200000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="runs/ns_inverse")
    return p.parse_args()


class HiddenPhysicsNet(nn.Module):
    def __init__(self, width, depth, lb, ub):
        super().__init__()
        dims = [3] + [width] * depth + [2]
        layers = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(nn.Tanh())
        self.mlp = nn.Sequential(*layers)
        self.lambda_1 = nn.Parameter(torch.zeros(1))
        self.log_lambda_2 = nn.Parameter(torch.tensor([-6.0]))
        self.register_buffer("lb", torch.as_tensor(lb, dtype=torch.float32))
        self.register_buffer("ub", torch.as_tensor(ub, dtype=torch.float32))

    def forward(self, t, x, y):
        h = torch.cat([x, y, t], dim=1)
        h = 2.0 * (h - self.lb) / (self.ub - self.lb) - 1.0
        out = self.mlp(h)
        psi, p = out[:, :1], out[:, 1:]
        grad = lambda f, z: torch.autograd.grad(f, z, torch.ones_like(f), create_graph=True)[0]
        u, v = grad(psi, y), -grad(psi, x)
        u_t, u_x, u_y = grad(u, t), grad(u, x), grad(u, y)
        v_t, v_x, v_y = grad(v, t), grad(v, x), grad(v, y)
        u_xx, u_yy = grad(u_x, x), grad(u_y, y)
        v_xx, v_yy = grad(v_x, x), grad(v_y, y)
        p_x, p_y = grad(p, x), grad(p, y)
        l1, l2 = self.lambda_1, torch.exp(self.log_lambda_2)
        f_u = u_t + l1 * (u * u_x + v * u_y) + p_x - l2 * (u_xx + u_yy)
        f_v = v_t + l1 * (u * v_x + v * v_y) + p_y - l2 * (v_xx + v_yy)
        return u, v, f_u, f_v


def load_wake(path):
    data = scipy.io.loadmat(path)
    U = data["U_star"]           # N x 2 x T
    t = data["t"].ravel()        # T
    X = data["X_star"]           # N x 2
    N, T = X.shape[0], t.shape[0]
    XX = np.tile(X[:, 0:1], (1, T)).ravel()
    YY = np.tile(X[:, 1:2], (1, T)).ravel()
    TT = np.tile(t[None, :], (N, 1)).ravel()
    uu = U[:, 0, :].ravel()
    vv = U[:, 1, :].ravel()
    return np.stack([TT, XX, YY, uu, vv], axis=1).astype(np.float32)


def to_cols(arr, device, requires_grad=False):
    cols = [torch.tensor(arr[:, i:i + 1], device=device, requires_grad=requires_grad) for i in range(3)]
    return cols, torch.tensor(arr[:, 3:5], device=device)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # per-rank streams for the minibatches
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    table = load_wake(args.mat)
    lb = table[:, [1, 2, 0]].min(0)
    ub = table[:, [1, 2, 0]].max(0)
    perm = np.random.permutation(table.shape[0])
    obs = table[perm[:args.n_obs]].copy()
    val = table[perm[args.n_obs:args.n_obs + args.n_val]].copy()
    if args.noise > 0:
        obs[:, 3:] += args.noise * obs[:, 3:].std(0) * np.random.randn(*obs[:, 3:].shape)

    net = HiddenPhysicsNet(args.width, args.depth, lb, ub).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.iters, eta_min=1e-5)

    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "state.pt")
    it0 = 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location=device)
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        it0 = st["iter"] + 1

    val_cols, val_uv = to_cols(val, device, requires_grad=True)
    t_start = time.time()
    for it in range(it0, args.iters):
        model.train()
        idx = np.random.choice(obs.shape[0], args.batch, replace=False)
        (t, x, y), uv = to_cols(obs[idx], device, requires_grad=True)
        u, v, f_u, f_v = model(t, x, y)
        loss_data = ((u - uv[:, :1]) ** 2).mean() + ((v - uv[:, 1:]) ** 2).mean()
        loss_pde = (f_u ** 2).mean() + (f_v ** 2).mean()
        loss = loss_data + loss_pde
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

        if (it + 1) % args.eval_every == 0:
            model.eval()
            u, v, _, _ = net(*val_cols)
            err = torch.stack([
                torch.linalg.norm(u.detach() - val_uv[:, :1]) ** 2,
                torch.linalg.norm(val_uv[:, :1]) ** 2,
                torch.linalg.norm(v.detach() - val_uv[:, 1:]) ** 2,
                torch.linalg.norm(val_uv[:, 1:]) ** 2,
                loss.detach(),
            ])
            dist.all_reduce(err)
            if rank == 0:
                l1 = net.lambda_1.item()
                l2 = torch.exp(net.log_lambda_2).item()
                print(f"it {it + 1:7d} | loss {err[4].item() / world:.3e} | val relL2 u "
                      f"{(err[0] / err[1]).sqrt().item():.3e} v {(err[2] / err[3]).sqrt().item():.3e} "
                      f"| l1 {l1:.4f} (err {abs(l1 - 1.0) * 100:.2f}%) l2 {l2:.5f} "
                      f"(err {abs(l2 - 0.01) / 0.01 * 100:.2f}%) | {time.time() - t_start:.0f}s", flush=True)
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict(), "iter": it}, ckpt)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
