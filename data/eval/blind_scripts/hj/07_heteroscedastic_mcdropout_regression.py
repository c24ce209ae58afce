"""Aleatoric + epistemic uncertainty for tabular regression (Kendall & Gal, 2017).

An MLP with MC dropout predicts a mean and a log-variance per target. The
mean head is first fitted with plain MSE for a few epochs (stabilises the
Gaussian NLL, cf. Seitzer et al. 2022), then both heads are trained with the
beta-NLL loss. At test time we draw T dropout samples and decompose the
predictive variance into aleatoric and epistemic parts.

Data: YearPredictionMSD (463k train / 51k test rows, 90 features).

    torchrun --nproc_per_node=8 07_heteroscedastic_mcdropout_regression.py --csv /data/uci/YearPredictionMSD.txt
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--out", default="runs/msd_hetero")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--p-drop", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--mse-epochs", type=int, default=5)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mc", type=int, default=50)
    return p.parse_args()


class HeteroMLP(nn.Module):
    def __init__(self, d_in, hidden, depth, p):
        super().__init__()
        layers, d = [], d_in
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.GELU(), nn.Dropout(p)]
            d = hidden
        self.body = nn.Sequential(*layers)
        self.mean_head = nn.Linear(hidden, 1)
        self.logvar_head = nn.Linear(hidden, 1)
        nn.init.constant_(self.logvar_head.bias, -2.0)

    def forward(self, x, with_var=True):
        h = self.body(x)
        mu = self.mean_head(h).squeeze(-1)
        if not with_var:
            return mu, None
        return mu, self.logvar_head(h).squeeze(-1).clamp(-10.0, 10.0)


def beta_nll(mu, logvar, y, beta):
    var = logvar.exp()
    nll = 0.5 * (logvar + (y - mu) ** 2 / var + math.log(2 * math.pi))
    if beta > 0:
        nll = nll * var.detach() ** beta
    return nll.mean()


def load_msd(path):
    df = pd.read_csv(path, header=None)
    arr = df.values.astype(np.float32)
    y, x = arr[:, 0], arr[:, 1:]
    # fixed split prescribed by the dataset (avoid producer effect)
    x_tr, y_tr, x_te, y_te = x[:463715], y[:463715], x[463715:], y[463715:]
    x_mu, x_sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    y_mu, y_sd = y_tr.mean(), y_tr.std()
    norm = lambda a, m, s: torch.from_numpy((a - m) / s)
    return (TensorDataset(norm(x_tr, x_mu, x_sd), norm(y_tr, y_mu, y_sd)),
            TensorDataset(norm(x_te, x_mu, x_sd), norm(y_te, y_mu, y_sd)), float(y_sd))


@torch.no_grad()
def mc_test(model, loader, device, T, y_sd):
    model.train()  # keep dropout active
    acc = torch.zeros(4, device=device, dtype=torch.float64)  # n, sq err, gaussian nll, epistemic var
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        mus, vars_ = [], []
        for _ in range(T):
            mu, lv = model(x)
            mus.append(mu)
            vars_.append(lv.exp())
        mus, vars_ = torch.stack(mus), torch.stack(vars_)
        mean = mus.mean(0)
        epi = mus.var(0, unbiased=False)
        total = vars_.mean(0) + epi
        nll = 0.5 * (total.log() + (y - mean) ** 2 / total + math.log(2 * math.pi)) + math.log(y_sd)
        acc += torch.stack([torch.tensor(float(y.numel()), device=device, dtype=torch.float64),
                            ((y - mean) ** 2).sum().double(), nll.sum().double(), epi.sum().double()])
    dist.all_reduce(acc)
    n = acc[0]
    return {"rmse": (acc[1] / n).sqrt().item() * y_sd, "nll": (acc[2] / n).item(),
            "epistemic_sd": (acc[3] / n).sqrt().item() * y_sd}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_ds, test_ds, y_sd = load_msd(args.csv)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)
    test_shard = torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world))
    test_loader = DataLoader(test_shard, batch_size=4096, shuffle=False)

    net = HeteroMLP(train_ds.tensors[0].shape[1], args.hidden, args.depth, args.p_drop).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        warm = epoch < args.mse_epochs
        t0, run = time.time(), torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if warm:
                mu, _ = model(x, with_var=False)
                loss = F.mse_loss(mu, y)
            else:
                mu, lv = model(x)
                loss = beta_nll(mu, lv, y, args.beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            m = mc_test(model.module, test_loader, device, args.mc, y_sd)
            if rank == 0:
                print(f"epoch {epoch} {'mse' if warm else 'bnll'} loss {(run[0] / run[1]).item():.4f} "
                      f"| test rmse {m['rmse']:.3f} nll {m['nll']:.3f} epi_sd {m['epistemic_sd']:.3f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, "model.pt"))
        elif rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
