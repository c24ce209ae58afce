"""DeepONet for the diffusion-reaction equation  u_t = D u_xx + k u^2 + f(x),
mapping the source term f (sampled from a GRF at 100 sensors) to u(x, t).

Trained data-parallel; the best model on the validation functions is kept and
evaluated on the held-out test functions at the end of the run.

    torchrun --standalone --nproc_per_node=4 20_deeponet_diffusion_reaction.py \
        --data /home/sciml/deeponet/dr_grf_l0.2.npz
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class OperatorPairs(Dataset):
    """One item = one input function with all of its (x, t) query points."""

    def __init__(self, f, xt, u):
        self.f = torch.from_numpy(f.astype(np.float32))  # (N, m)
        self.xt = torch.from_numpy(xt.astype(np.float32))  # (P, 2), shared grid
        self.u = torch.from_numpy(u.astype(np.float32))  # (N, P)

    def __len__(self):
        return self.f.shape[0]

    def __getitem__(self, i):
        return self.f[i], self.u[i]


def mlp(sizes, act=nn.Tanh):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


class DeepONet(nn.Module):
    def __init__(self, m_sensors, width=128, depth=4, p=128):
        super().__init__()
        self.branch = mlp([m_sensors] + [width] * depth + [p], act=nn.GELU)
        self.trunk = mlp([2] + [width] * depth + [p])
        self.b0 = nn.Parameter(torch.zeros(1))

    def forward(self, f, xt):
        # f: (B, m), xt: (P, 2) -> (B, P)
        return self.branch(f) @ self.trunk(xt).T + self.b0


def split(npz, n_val):
    d = np.load(npz)
    f_tr, u_tr = d["f_train"], d["u_train"]
    return ((f_tr[n_val:], u_tr[n_val:]), (f_tr[:n_val], u_tr[:n_val]),
            (d["f_test"], d["u_test"]), d["xt"])


def rel_l2(pred, u):
    return torch.linalg.norm(pred - u, dim=-1) / torch.linalg.norm(u, dim=-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/home/sciml/deeponet/dr_grf_l0.2.npz")
    ap.add_argument("--out", default="/home/sciml/deeponet/runs/dr")
    ap.add_argument("--n-val", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--points-per-function", type=int, default=1000, help="random query points per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--iters", type=int, default=100000)
    ap.add_argument("--eval-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    (f_tr, u_tr), (f_va, u_va), (f_te, u_te), xt = split(args.data, args.n_val)
    train_ds = OperatorPairs(f_tr, xt, u_tr)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=2)
    xt_dev = torch.from_numpy(xt.astype(np.float32)).to(device)
    f_va_t = torch.from_numpy(f_va.astype(np.float32))[rank::world].to(device)
    u_va_t = torch.from_numpy(u_va.astype(np.float32))[rank::world].to(device)

    model = DDP(DeepONet(f_tr.shape[1]).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
    best_path = os.path.join(args.out, "deeponet_best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    it, epoch, best, t0 = 0, 0, float("inf"), time.time()
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    while it < args.iters:
        sampler.set_epoch(epoch)
        model.train()
        for f, u in loader:
            f, u = f.to(device, non_blocking=True), u.to(device, non_blocking=True)
            idx = torch.randint(0, xt_dev.shape[0], (args.points_per_function,), device=device, generator=gen)
            pred = model(f, xt_dev[idx])
            loss = ((pred - u[:, idx]) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            it += 1
            if it % 2000 == 0:
                sched.step()

            if it % args.eval_every == 0:
                with torch.no_grad():
                    err = rel_l2(model.module(f_va_t, xt_dev), u_va_t)
                s = torch.stack([err.sum(), torch.tensor(float(err.numel()), device=device)])
                dist.all_reduce(s)
                val = (s[0] / s[1]).item()
                if rank == 0:
                    print(f"it {it:6d} loss {loss.item():.3e} val relL2 {val:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
                    if val < best:
                        best = val
                        torch.save(model.state_dict(), best_path)
            if it >= args.iters:
                break
        epoch += 1

    dist.barrier()
    if rank == 0:
        net = DeepONet(f_tr.shape[1]).to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        net.eval()
        with torch.no_grad():
            f_te_t = torch.from_numpy(f_te.astype(np.float32)).to(device)
            u_te_t = torch.from_numpy(u_te.astype(np.float32)).to(device)
            pred = net(f_te_t, xt_dev)
            err = rel_l2(pred, u_te_t)
        print(f"test relL2 mean {err.mean():.4f} median {err.median():.4f} max {err.max():.4f}", flush=True)
        np.savez(os.path.join(args.out, "test_predictions.npz"), pred=pred.cpu().numpy(), err=err.cpu().numpy())
        with open(os.path.join(args.out, "summary.json"), "w") as fh:
            json.dump({"best_val_rel_l2": best, "test_rel_l2": err.mean().item(), "iters": it}, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
