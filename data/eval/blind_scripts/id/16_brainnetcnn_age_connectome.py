"""Brain-age regression from resting-state functional connectomes (BrainNetCNN).

Connectomes: Fisher-z Pearson correlation between the 200 Schaefer parcels of
the resting-state run, one matrix per subject, stored together with the
phenotype table:

    connectomes.npy   (n_subjects, 200, 200) float32
    phenotypes.csv    eid, age, sex, site, split (train / val / test)

Site effects are removed with per-site edge-wise standardisation, estimated
on the training subjects of each site.  Reported metric: MAE in years.
"""
import argparse
import os
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="/data/ukb_rsfmri/schaefer200")
    p.add_argument("--out_dir", default="runs/brainage_bnc")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=5e-4)
    p.add_argument("--e2e", type=int, default=32)
    p.add_argument("--e2n", type=int, default=64)
    p.add_argument("--n2g", type=int, default=256)
    p.add_argument("--wandb_project", default="brain-age")
    p.add_argument("--run_name", default=None)
    return p.parse_args()


def site_standardise(C, sites, train_mask):
    C = C.copy()
    for s in np.unique(sites):
        m = sites == s
        ref = m & train_mask
        mu = C[ref].mean(0)
        sd = C[ref].std(0) + 1e-6
        C[m] = (C[m] - mu) / sd
    return C


class E2EBlock(nn.Module):
    """Edge-to-edge filter: cross-shaped convolution over the adjacency matrix."""

    def __init__(self, c_in, c_out, n):
        super().__init__()
        self.row = nn.Conv2d(c_in, c_out, (1, n))
        self.col = nn.Conv2d(c_in, c_out, (n, 1))
        self.n = n

    def forward(self, x):
        r = self.row(x)  # (B, C, n, 1)
        c = self.col(x)  # (B, C, 1, n)
        return r.expand(-1, -1, -1, self.n) + c.expand(-1, -1, self.n, -1)


class BrainNetCNN(nn.Module):
    def __init__(self, n=200, e2e=32, e2n=64, n2g=256, drop=0.5):
        super().__init__()
        self.e2e1 = E2EBlock(1, e2e, n)
        self.e2e2 = E2EBlock(e2e, e2e, n)
        self.e2n = nn.Conv2d(e2e, e2n, (1, n))
        self.n2g = nn.Conv2d(e2n, n2g, (n, 1))
        self.fc = nn.Sequential(nn.Dropout(drop), nn.Linear(n2g, 128), nn.LeakyReLU(0.33),
                                nn.Dropout(drop), nn.Linear(128, 30), nn.LeakyReLU(0.33), nn.Linear(30, 1))

    def forward(self, x):
        x = F.leaky_relu(self.e2e1(x), 0.33)
        x = F.leaky_relu(self.e2e2(x), 0.33)
        x = F.leaky_relu(self.e2n(x), 0.33)
        x = F.leaky_relu(self.n2g(x), 0.33)
        return self.fc(x.flatten(1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, device, age_mean, age_std):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)  # abs err, sq err, n
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        pred = model(x) * age_std + age_mean
        err = pred - (y * age_std + age_mean)
        s += torch.stack([err.abs().sum(), (err ** 2).sum(), torch.tensor(len(y), device=device, dtype=err.dtype)]).double()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).sqrt().item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    os.makedirs(args.out_dir, exist_ok=True)
    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args),
                     dir=args.out_dir)

    C = np.load(Path(args.data_dir) / "connectomes.npy")
    ph = pd.read_csv(Path(args.data_dir) / "phenotypes.csv")
    train_mask = (ph.split == "train").to_numpy()
    C = site_standardise(C, ph.site.to_numpy(), train_mask)
    age = ph.age.to_numpy().astype(np.float32)
    age_mean, age_std = float(age[train_mask].mean()), float(age[train_mask].std())
    age_z = (age - age_mean) / age_std

    def make(split, shuffle):
        m = (ph.split == split).to_numpy()
        ds = TensorDataset(torch.from_numpy(C[m][:, None]).float(), torch.from_numpy(age_z[m]))
        if not shuffle:  # evaluation: each subject exactly once across ranks
            return DataLoader(Subset(ds, range(rank, len(ds), world_size)), batch_size=args.batch_size,
                              shuffle=False, num_workers=2), None
        sampler = DistributedSampler(ds, shuffle=True)
        return DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                          pin_memory=True, drop_last=True), sampler

    train_dl, train_sampler = make("train", True)
    val_dl, _ = make("val", False)
    test_dl, _ = make("test", False)

    model = BrainNetCNN(n=C.shape[1], e2e=args.e2e, e2n=args.e2n, n2g=args.n2g).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=10)

    best_mae = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.smooth_l1_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(tot)

        val_mae, val_rmse = evaluate(model.module, val_dl, device, age_mean, age_std)
        sched.step(val_mae)
        run.log({"epoch": epoch, "train/loss": (tot[0] / tot[1]).item(), "val/mae": val_mae,
                 "val/rmse": val_rmse, "lr": opt.param_groups[0]["lr"]})
        if val_mae < best_mae:
            best_mae = val_mae
            if rank == 0:
                torch.save(model.module.state_dict(), Path(args.out_dir) / "best.pt")
                print(f"epoch {epoch}: new best val MAE {val_mae:.3f} y (RMSE {val_rmse:.3f})", flush=True)

    dist.barrier()
    model.module.load_state_dict(torch.load(Path(args.out_dir) / "best.pt", map_location=device))
    test_mae, test_rmse = evaluate(model.module, test_dl, device, age_mean, age_std)
    run.summary["test/mae"] = test_mae
    run.summary["test/rmse"] = test_rmse
    if rank == 0:
        print(f"test MAE {test_mae:.3f} y, RMSE {test_rmse:.3f} y")
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
