"""Basenji2-style model: 131 kb DNA -> 1024 x 128 bp bins of coverage for human tracks.

Data converted from the Basenji TFRecords to HDF5 (seqs: N x 131072 uint8 codes 0-3/4=N,
targets: N x 1024 x T float16). Poisson loss; validation Pearson r per track.

    torchrun --nproc_per_node=8 19_basenji_coverage.py --train /data/basenji/human_train.h5 \
        --valid /data/basenji/human_valid.h5 --out runs/basenji2_human
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=2, help="per GPU; 131 kb inputs")
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--shift", type=int, default=3, help="max random shift augmentation (bp)")
    return ap.parse_args()


class CoverageH5(Dataset):
    def __init__(self, path, augment, max_shift=3):
        self.path, self.augment, self.f = path, augment, None
        self.max_shift = max_shift
        with h5py.File(path, "r") as f:
            self.n, self.n_tracks = f["seqs"].shape[0], f["targets"].shape[2]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        codes = self.f["seqs"][i].astype(np.int64)
        y = self.f["targets"][i].astype(np.float32)
        if self.augment:
            s = np.random.randint(-self.max_shift, self.max_shift + 1)
            codes = np.roll(codes, s)
            if np.random.rand() < 0.5:  # reverse complement
                codes = np.where(codes < 4, 3 - codes, 4)[::-1].copy()
                y = y[::-1].copy()
        x = F.one_hot(torch.from_numpy(codes), 5)[:, :4].T.float()  # N -> all zeros
        return x, torch.from_numpy(y)


def conv_block(cin, cout, k, dilation=1, pool=1, dropout=0.0):
    layers = [nn.GELU(), nn.Conv1d(cin, cout, k, padding=dilation * (k // 2), dilation=dilation),
              nn.BatchNorm1d(cout, momentum=0.1)]
    if dropout:
        layers.append(nn.Dropout(dropout))
    if pool > 1:
        layers.append(nn.MaxPool1d(pool))
    return nn.Sequential(*layers)


class DilatedResidual(nn.Module):
    def __init__(self, c, dilation):
        super().__init__()
        self.a = conv_block(c, c // 2, 3, dilation=dilation)
        self.b = conv_block(c // 2, c, 1, dropout=0.3)

    def forward(self, x):
        return x + self.b(self.a(x))


class Basenji2(nn.Module):
    def __init__(self, n_tracks, c=768):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(4, 288, 15, padding=7), nn.BatchNorm1d(288), nn.MaxPool1d(2))
        tower, cin = [], 288
        for k in range(6):  # 65536 -> 1024 bins of 128 bp
            cout = int(round(288 * 1.1776 ** (k + 1)))
            tower.append(conv_block(cin, cout, 5, pool=2))
            cin = cout
        self.tower = nn.Sequential(*tower)
        self.dilated = nn.Sequential(*[DilatedResidual(cin, int(round(1.5 ** d))) for d in range(11)])
        self.final = conv_block(cin, 2 * c, 1, dropout=0.05)
        self.head = nn.Conv1d(2 * c, n_tracks, 1)

    def forward(self, x):
        h = self.dilated(self.tower(self.stem(x)))
        h = F.gelu(self.final(h))
        return F.softplus(self.head(h)).transpose(1, 2)  # B, bins, tracks


@torch.no_grad()
def pearson_per_track(model, loader, device, n_tracks):
    model.eval()
    s = torch.zeros(6, n_tracks, device=device, dtype=torch.float64)
    for x, y in loader:
        p = model(x.to(device)).double().flatten(0, 1)
        t = y.to(device).double().flatten(0, 1)
        s += torch.stack([p.sum(0), t.sum(0), (p * p).sum(0), (t * t).sum(0), (p * t).sum(0),
                          torch.full((n_tracks,), p.shape[0], device=device, dtype=torch.float64)])
    dist.all_reduce(s)
    sp, st, spp, stt, spt, n = s
    cov = spt / n - sp * st / n ** 2
    r = cov / torch.sqrt((spp / n - (sp / n) ** 2) * (stt / n - (st / n) ** 2) + 1e-12)
    model.train()
    return r.cpu().numpy()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds, valid_ds = CoverageH5(args.train, augment=True, max_shift=args.shift), CoverageH5(args.valid, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid_ds, batch_size=4, num_workers=4,
                              sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True))

    model = Basenji2(train_ds.n_tracks).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    warmup = 20000
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    best_r = -1.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = F.poisson_nll_loss(pred, y, log_input=False)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} poisson {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        r = pearson_per_track(model, valid_loader, device, train_ds.n_tracks)
        mean_r = float(np.nanmean(r))
        if rank == 0:
            print(f"epoch {epoch}: valid mean Pearson r {mean_r:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "r": r},
                       os.path.join(args.out, "last.pt"))
            if mean_r > best_r:
                best_r = mean_r
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "r": r},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
