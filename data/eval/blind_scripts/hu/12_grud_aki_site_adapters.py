"""
GRU-D for acute kidney injury (KDIGO stage >= 2 within 48h) across six hospitals.

Shared GRU-D encoder; every hospital gets its own small adapter + output layer so that
site-specific calibration and case-mix are absorbed outside the shared encoder.

    torchrun --nproc_per_node=4 12_grud_aki_site_adapters.py --data /data/aki/multisite.h5
"""
import argparse
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SITES = ["hosp_a", "hosp_b", "hosp_c", "hosp_d", "hosp_e", "hosp_f"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out_dir", default="runs/grud_aki")
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--adapter_dim", type=int, default=32)
    p.add_argument("--batch_size", type=int, default=48)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


class H5Stays(Dataset):
    """x, mask, delta: [N, T, V]; x_mean: [V] empirical mean from the train split."""

    def __init__(self, path, split):
        self.path, self.split = path, split
        with h5py.File(path, "r") as f:
            self.n = f[split]["y"].shape[0]
            self.y = f[split]["y"][:].astype(np.float32)
            self.site = f[split]["site"][:].astype(np.int64)
            self.x_mean = f["train_mean"][:].astype(np.float32)
        self._f = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self._f is None:  # open lazily in each worker
            self._f = h5py.File(self.path, "r")
        g = self._f[self.split]
        return (torch.from_numpy(g["x"][i].astype(np.float32)),
                torch.from_numpy(g["mask"][i].astype(np.float32)),
                torch.from_numpy(g["delta"][i].astype(np.float32)),
                int(self.site[i]), float(self.y[i]))


class GRUD(nn.Module):
    def __init__(self, n_vars, hidden, x_mean):
        super().__init__()
        self.register_buffer("x_mean", torch.as_tensor(x_mean))
        self.gamma_x = nn.Linear(n_vars, n_vars)
        self.gamma_h = nn.Linear(n_vars, hidden)
        self.cell = nn.GRUCell(2 * n_vars, hidden)
        self.hidden = hidden

    def forward(self, x, m, d):
        B, T, V = x.shape
        h = x.new_zeros(B, self.hidden)
        x_last = self.x_mean.expand(B, V)
        for t in range(T):
            xt, mt, dt = x[:, t], m[:, t], d[:, t]
            gx = torch.exp(-F.relu(self.gamma_x(dt)))
            gh = torch.exp(-F.relu(self.gamma_h(dt)))
            x_last = torch.where(mt > 0, xt, x_last)
            x_hat = mt * xt + (1 - mt) * (gx * x_last + (1 - gx) * self.x_mean)
            h = self.cell(torch.cat([x_hat, mt], dim=-1), gh * h)
        return h


class MultiSiteModel(nn.Module):
    def __init__(self, n_vars, hidden, adapter_dim, x_mean, n_sites):
        super().__init__()
        self.encoder = GRUD(n_vars, hidden, x_mean)
        self.adapters = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, adapter_dim), nn.Tanh(), nn.Linear(adapter_dim, 1))
            for _ in range(n_sites)
        )

    def forward(self, x, m, d, site):
        h = self.encoder(x, m, d)
        logits = h.new_zeros(h.size(0))
        for s in site.unique().tolist():
            sel = site == s
            logits[sel] = self.adapters[s](h[sel]).squeeze(-1)
        return logits


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    p = torch.zeros(n, device=device)
    y = torch.zeros(n, device=device)
    s = torch.zeros(n, dtype=torch.long, device=device)
    cnt = torch.zeros(n, device=device)
    for (x, m, d, site, label), idx in loader:
        idx = idx.to(device)
        site = site.to(device)
        p[idx] += torch.sigmoid(model(x.to(device), m.to(device), d.to(device), site))
        y[idx] = label.to(device).float()
        s[idx] = site
        cnt[idx] += 1
    for t in (p, y, cnt):
        dist.all_reduce(t)
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    p = (p / cnt.clamp(min=1)).cpu().numpy()
    y = (y / cnt.clamp(min=1)).cpu().numpy()
    s = s.cpu().numpy()
    res = {"all": roc_auc_score(y, p)}
    for k, name in enumerate(SITES):
        sel = s == k
        if sel.any() and 0 < y[sel].sum() < sel.sum():
            res[name] = roc_auc_score(y[sel], p[sel])
    return res


class WithIndex(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i], i


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train = H5Stays(args.data, "train")
    val = H5Stays(args.data, "val")
    tr_sampler = DistributedSampler(train, shuffle=True)
    tr_loader = DataLoader(train, batch_size=args.batch_size, sampler=tr_sampler,
                           num_workers=args.workers, pin_memory=True, drop_last=True)
    va_ds = WithIndex(val)
    va_loader = DataLoader(va_ds, batch_size=256, sampler=DistributedSampler(va_ds, shuffle=False),
                           num_workers=args.workers)

    n_vars = train.x_mean.shape[0]
    model = MultiSiteModel(n_vars, args.hidden, args.adapter_dim, train.x_mean, len(SITES)).to(device)
    model = DDP(model, device_ids=[local_rank])

    # per-site positive weights: AKI prevalence differs a lot between hospitals
    prev = np.array([train.y[train.site == k].mean() for k in range(len(SITES))])
    site_pos_w = torch.tensor((1 - prev) / prev, dtype=torch.float32, device=device)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 22], gamma=0.2)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, m, d, site, y in tr_loader:
            x, m, d = x.to(device, non_blocking=True), m.to(device, non_blocking=True), d.to(device, non_blocking=True)
            site, y = site.to(device), y.to(device).float()
            logits = model(x, m, d, site)
            loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=site_pos_w[site])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        res = evaluate(model, va_loader, device, len(val))
        if rank == 0:
            per_site = " ".join(f"{k}={v:.3f}" for k, v in res.items() if k != "all")
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} AUROC {res['all']:.4f} | {per_site}",
                  flush=True)
            if res["all"] > best:
                best = res["all"]
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
