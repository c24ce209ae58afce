"""Deep ensembles for regression (Lakshminarayanan et al., 2017), one member per GPU.

Each member is a Gaussian MLP trained with the NLL and FGSM adversarial
examples. Members are trained independently (different seeds, no gradient
sync); at the end the per-member means/variances are gathered and combined
into the mixture mean and variance.

    python 09_deep_ensemble_regression_spawn.py --csv data/protein.csv --members 8
"""
import argparse
import json
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class GaussianMLP(nn.Module):
    def __init__(self, d_in, hidden=(100, 100)):
        super().__init__()
        layers, d = [], d_in
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.net = nn.Sequential(*layers)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        mu, raw = self.out(self.net(x)).unbind(-1)
        var = F.softplus(raw) + 1e-6
        return mu, var


def gaussian_nll(mu, var, y):
    return 0.5 * (var.log() + (y - mu) ** 2 / var).mean()


def load_split(path, test_frac, split_seed):
    df = pd.read_csv(path)
    y = df.iloc[:, 0].to_numpy(np.float32)
    x = df.iloc[:, 1:].to_numpy(np.float32)
    # the split must be identical for all members -> dedicated generator
    g = torch.Generator().manual_seed(split_seed)
    perm = torch.randperm(len(y), generator=g).numpy()
    n_test = int(len(y) * test_frac)
    te, tr = perm[:n_test], perm[n_test:]
    x_mu, x_sd = x[tr].mean(0), x[tr].std(0) + 1e-8
    y_mu, y_sd = y[tr].mean(), y[tr].std()
    xs = (x - x_mu) / x_sd
    ys = (y - y_mu) / y_sd
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    return t(xs[tr]), t(ys[tr]), t(xs[te]), t(ys[te]), float(y_mu), float(y_sd)


def train_member(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    # member-specific randomness: init, minibatch order, nothing else
    seed = args.seed + 100 * rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    x_tr, y_tr, x_te, y_te, y_mu, y_sd = load_split(args.csv, args.test_frac, args.split_seed)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=args.batch_size, shuffle=True,
                        drop_last=False, num_workers=0)

    model = GaussianMLP(x_tr.shape[1], tuple(args.hidden)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=args.epochs // 3, gamma=0.3)
    eps = args.adv_eps * x_tr.std(0).mean().item()

    for epoch in range(args.epochs):
        model.train()
        tot, n = 0.0, 0
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            xb.requires_grad_(True)
            mu, var = model(xb)
            loss = gaussian_nll(mu, var, yb)
            if args.adv_eps > 0:
                grad, = torch.autograd.grad(loss, xb, retain_graph=True)
                x_adv = (xb + eps * grad.sign()).detach()
                mu_a, var_a = model(x_adv)
                loss = loss + gaussian_nll(mu_a, var_a, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item() * yb.numel()
            n += yb.numel()
        sched.step()
        if epoch % 20 == 0:
            print(f"[member {rank}] epoch {epoch} loss {tot / n:.4f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    torch.save({"model": model.state_dict(), "seed": seed, "y_mu": y_mu, "y_sd": y_sd},
               os.path.join(args.out, f"member_{rank:02d}.pt"))

    # every member predicts the full (identical) test split
    model.eval()
    with torch.no_grad():
        mu, var = model(x_te.to(device))
    pred = torch.stack([mu, var])  # [2, N_test]
    gathered = [torch.empty_like(pred) for _ in range(world_size)]
    dist.all_gather(gathered, pred)

    if rank == 0:
        P = torch.stack(gathered)  # [M, 2, N]
        mus, vars_ = P[:, 0], P[:, 1]
        y = y_te.to(device)
        ens_mu = mus.mean(0)
        ens_var = (vars_ + mus ** 2).mean(0) - ens_mu ** 2
        rmse = lambda m: ((m - y) ** 2).mean().sqrt().item() * y_sd
        nll = lambda m, v: (0.5 * (v.log() + (y - m) ** 2 / v + np.log(2 * np.pi))).mean().item() + np.log(y_sd)
        res = {
            "members": world_size,
            "ensemble_rmse": rmse(ens_mu),
            "ensemble_nll": nll(ens_mu, ens_var),
            "member_rmse": [rmse(mus[i]) for i in range(world_size)],
            "member_nll": [nll(mus[i], vars_[i]) for i in range(world_size)],
        }
        print(json.dumps(res, indent=2))
        with open(os.path.join(args.out, "ensemble_results.json"), "w") as f:
            json.dump(res, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="runs/de_regression")
    p.add_argument("--members", type=int, default=0, help="0 = one per visible GPU")
    p.add_argument("--hidden", type=int, nargs="+", default=[100, 100])
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--adv-eps", type=float, default=0.01)
    p.add_argument("--test-frac", type=float, default=0.1)
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args()

    n_gpus = torch.cuda.device_count()
    world_size = args.members or n_gpus
    if world_size > n_gpus:
        raise SystemExit(f"asked for {world_size} members but only {n_gpus} GPUs are visible")
    mp.spawn(train_member, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
