"""DeepFinder-style multi-class particle localisation in cryo-ET.

Targets are sphere masks painted at the annotated particle coordinates (one class per
macromolecule).  Tomograms and targets are read from a STAR-like table; a fraction of
the tomograms is held out for validation.

    torchrun --nproc_per_node=4 10_deepfinder_tomo_split.py --table /data/shrec21/objects.csv \
        --tomo-dir /data/shrec21/tomos --out /data/shrec21/runs/df_ddp_01
"""
import argparse
import csv
import os
import random
import time
from collections import defaultdict

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PARTICLES = ["4CR2", "1QVR", "1BXN", "3CF3", "1U6G", "3D2F", "2CG9", "3H84", "1S3X", "5MRC", "vesicle", "fiducial"]


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--table", required=True)
    p.add_argument("--tomo-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--val-frac", type=float, default=0.2)
    p.add_argument("--patch", type=int, default=56)
    p.add_argument("--radius", type=int, default=5)
    p.add_argument("--samples-per-epoch", type=int, default=6400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def read_objects(table):
    objs = defaultdict(list)
    with open(table) as f:
        for row in csv.DictReader(f):
            objs[row["tomo"]].append((PARTICLES.index(row["class"]) + 1,
                                      int(float(row["z"])), int(float(row["y"])), int(float(row["x"]))))
    return objs


def paint_targets(shape, objects, radius):
    tgt = np.zeros(shape, dtype=np.uint8)
    r = radius
    zz, yy, xx = np.mgrid[-r:r + 1, -r:r + 1, -r:r + 1]
    ball = zz ** 2 + yy ** 2 + xx ** 2 <= r ** 2
    for cls, z, y, x in objects:
        sl = (slice(z - r, z + r + 1), slice(y - r, y + r + 1), slice(x - r, x + r + 1))
        if any(s.start < 0 or s.stop > d for s, d in zip(sl, shape)):
            continue
        tgt[sl][ball] = cls
    return tgt


class ParticlePatches(Dataset):
    def __init__(self, tomos, objects, patch, n, radius, jitter=True):
        self.tomos = tomos          # name -> normalised volume
        self.targets = {k: paint_targets(v.shape, objects[k], radius) for k, v in tomos.items()}
        self.centers = [(k, z, y, x) for k in tomos for _, z, y, x in objects[k]]
        self.patch, self.n, self.jitter = patch, n, jitter

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        name, z, y, x = self.centers[idx % len(self.centers)]
        vol, tgt = self.tomos[name], self.targets[name]
        h = self.patch // 2
        if self.jitter:
            z, y, x = (c + np.random.randint(-h // 2, h // 2 + 1) for c in (z, y, x))
        z = int(np.clip(z, h, vol.shape[0] - h))
        y = int(np.clip(y, h, vol.shape[1] - h))
        x = int(np.clip(x, h, vol.shape[2] - h))
        v = vol[z - h:z + h, y - h:y + h, x - h:x + h]
        t = tgt[z - h:z + h, y - h:y + h, x - h:x + h]
        if self.jitter and np.random.rand() < 0.5:
            v, t = np.rot90(v, 2, (0, 2)), np.rot90(t, 2, (0, 2))
        return torch.from_numpy(v.copy())[None], torch.from_numpy(t.astype(np.int64))


def c3(i, o):
    return nn.Sequential(nn.Conv3d(i, o, 3, padding=1), nn.ReLU(inplace=True))


class DeepFinderNet(nn.Module):
    def __init__(self, n_cls):
        super().__init__()
        self.l1 = nn.Sequential(c3(1, 32), c3(32, 32))
        self.l2 = nn.Sequential(c3(32, 48), c3(48, 48))
        self.l3 = nn.Sequential(c3(48, 64), c3(64, 64), c3(64, 64), c3(64, 64))
        self.u2 = nn.ConvTranspose3d(64, 64, 2, 2)
        self.r2 = nn.Sequential(c3(112, 48), c3(48, 48))
        self.u1 = nn.ConvTranspose3d(48, 48, 2, 2)
        self.r1 = nn.Sequential(c3(80, 32), c3(32, 32))
        self.out = nn.Conv3d(32, n_cls, 1)

    def forward(self, x):
        a = self.l1(x)
        b = self.l2(F.max_pool3d(a, 2))
        c = self.l3(F.max_pool3d(b, 2))
        y = self.r2(torch.cat([self.u2(c), b], 1))
        y = self.r1(torch.cat([self.u1(y), a], 1))
        return self.out(y)


def load_tomo(path):
    with mrcfile.open(path, permissive=True) as m:
        v = m.data.astype(np.float32)
    return (v - v.mean()) / (v.std() + 1e-6)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation streams on every GPU
    seed_everything(args.seed + rank)

    objects = read_objects(args.table)
    names = sorted(objects)
    random.shuffle(names)
    n_val = max(1, int(round(args.val_frac * len(names))))
    val_names, train_names = names[:n_val], names[n_val:]

    tomos = {n: load_tomo(os.path.join(args.tomo_dir, f"{n}.mrc")) for n in names}
    train_ds = ParticlePatches({n: tomos[n] for n in train_names}, objects, args.patch, args.samples_per_epoch,
                                args.radius)
    val_ds = ParticlePatches({n: tomos[n] for n in val_names}, objects, args.patch, 512 * world, args.radius,
                              jitter=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=val_sampler, num_workers=2)

    n_cls = len(PARTICLES) + 1
    model = DDP(DeepFinderNet(n_cls).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    weights = torch.ones(n_cls, device=device)
    weights[0] = 0.2

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train tomos {train_names}\nval tomos {val_names}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, weight=weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        tp = torch.zeros(n_cls, device=device)
        fp = torch.zeros(n_cls, device=device)
        fn = torch.zeros(n_cls, device=device)
        with torch.no_grad():
            for x, y in val_dl:
                p = model.module(x.to(device)).argmax(1)
                y = y.to(device)
                for c in range(1, n_cls):
                    tp[c] += ((p == c) & (y == c)).sum()
                    fp[c] += ((p == c) & (y != c)).sum()
                    fn[c] += ((p != c) & (y == c)).sum()
        for t in (tp, fp, fn):
            dist.all_reduce(t)
        f1 = 2 * tp[1:] / (2 * tp[1:] + fp[1:] + fn[1:]).clamp(min=1)
        mf1 = f1.mean().item()
        if rank == 0:
            print(f"epoch {epoch} last-batch loss {loss.item():.4f} val mean F1 {mf1:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": model.module.state_dict(), "epoch": epoch, "f1": mf1,
                  "train_tomos": train_names, "val_tomos": val_names}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if mf1 > best:
                best = mf1
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
