"""Photometric redshifts from SDSS ugriz cutouts (Pasquet+2019-like), redshift-bin classifier.

Input h5 (make_cutouts.py): images [N, 5, 64, 64] float32 (asinh mags), ebv [N], zspec [N].
Output is a pdf over n_bins redshift bins in [0, z_max]; point estimate = pdf mean.

    torchrun --nproc_per_node=4 13_sdss_photoz_cnn.py --h5 /data/sdss/mgs_cutouts_64.h5 --out runs/photoz
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Cutouts(Dataset):
    def __init__(self, path, index, augment=False):
        self.path, self.index, self.augment = path, np.sort(index), augment
        self.h5 = None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        if self.h5 is None:
            self.h5 = h5py.File(self.path, "r")
        j = self.index[i]
        img = torch.from_numpy(self.h5["images"][j])
        if self.augment:
            img = torch.rot90(img, int(np.random.randint(4)), dims=(1, 2))
            if np.random.rand() < 0.5:
                img = img.flip(2)
        return img, torch.tensor(self.h5["ebv"][j], dtype=torch.float32), \
            torch.tensor(self.h5["zspec"][j], dtype=torch.float32)


class Inception(nn.Module):
    def __init__(self, cin, c1, c3, c5, pool=True):
        super().__init__()
        self.b1 = nn.Conv2d(cin, c1, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, c3, 1), nn.PReLU(), nn.Conv2d(c3, c3, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, c5, 1), nn.PReLU(), nn.Conv2d(c5, c5, 5, padding=2))
        self.bp = nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.Conv2d(cin, c1, 1))
        self.act = nn.PReLU()
        self.pool = nn.AvgPool2d(2) if pool else nn.Identity()

    def forward(self, x):
        return self.pool(self.act(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)))


class PhotoZNet(nn.Module):
    def __init__(self, n_bins=180):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(5, 64, 5, padding=2), nn.PReLU(),
                                  nn.Conv2d(64, 64, 3, padding=1), nn.PReLU(), nn.AvgPool2d(2))
        self.incep = nn.Sequential(Inception(64, 48, 64, 32), Inception(192, 64, 92, 48),
                                   Inception(268, 92, 128, 64), Inception(376, 92, 128, 64, pool=False))
        self.fc = nn.Sequential(nn.Linear(376 * 4 * 4 + 1, 1024), nn.ReLU(), nn.Dropout(0.3),
                                nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, n_bins))

    def forward(self, img, ebv):
        h = self.incep(self.stem(img)).flatten(1)
        return self.fc(torch.cat([h, ebv.unsqueeze(1)], 1))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--h5", required=True)
    p.add_argument("--out", default="runs/photoz")
    p.add_argument("--n-bins", type=int, default=180)
    p.add_argument("--z-max", type=float, default=0.4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--test-frac", type=float, default=0.2)
    return p.parse_args()


@torch.no_grad()
def validate(model, loader, centers, device):
    model.eval()
    n, sum_dz, sum_dz2, n_out, nll = 0, 0.0, 0.0, 0, 0.0
    for img, ebv, z in loader:
        img, ebv, z = img.to(device), ebv.to(device), z.to(device)
        logits = model(img, ebv)
        pdf = logits.softmax(1)
        zphot = (pdf * centers).sum(1)
        dz = (zphot - z) / (1 + z)
        n += z.numel()
        sum_dz += dz.sum().item()
        sum_dz2 += (dz ** 2).sum().item()
        n_out += (dz.abs() > 0.05).sum().item()
        bins = torch.bucketize(z, centers - 0.5 * (centers[1] - centers[0])) - 1
        nll += F.cross_entropy(logits, bins.clamp(0, len(centers) - 1), reduction="sum").item()
    totals = torch.tensor([n, sum_dz, sum_dz2, n_out, nll], dtype=torch.float64)
    dist.all_reduce(totals)
    n, sum_dz, sum_dz2, n_out, nll = totals.tolist()
    bias = sum_dz / n
    return {"bias": bias, "sigma": (sum_dz2 / n - bias ** 2) ** 0.5, "eta_out": n_out / n, "nll": nll / n}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with h5py.File(args.h5, "r") as f:
        n_total = f["zspec"].shape[0]
    perm = np.random.RandomState(0).permutation(n_total)
    n_test = int(args.test_frac * n_total)
    train_ds = Cutouts(args.h5, perm[n_test:], augment=True)
    val_ds = Cutouts(args.h5, perm[:n_test][rank::world])

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=512, num_workers=4, pin_memory=True)

    edges = torch.linspace(0, args.z_max, args.n_bins + 1, device=device)
    centers = 0.5 * (edges[1:] + edges[:-1])

    model = DDP(PhotoZNet(args.n_bins).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[30, 45], gamma=0.3)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_sigma = 1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (img, ebv, z) in enumerate(train_dl):
            img, ebv, z = img.to(device, non_blocking=True), ebv.to(device), z.to(device)
            target = (torch.bucketize(z, edges) - 1).clamp(0, args.n_bins - 1)
            loss = F.cross_entropy(model(img, ebv), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        sched.step()

        metrics = validate(model.module, val_dl, centers, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) bias {metrics['bias']:+.5f} "
                  f"sigma {metrics['sigma']:.5f} eta_out {metrics['eta_out']:.4f} nll {metrics['nll']:.3f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "bin_edges": edges.cpu()}, os.path.join(args.out, "last.pt"))
            if metrics["sigma"] < best_sigma:
                best_sigma = metrics["sigma"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
