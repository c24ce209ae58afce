"""Affinity prediction for serial-section EM (CREMI A/B/C) with a 3D U-Net.

- SyncBatchNorm: with 1-2 anisotropic patches per GPU, per-GPU BN statistics are useless
- gradient accumulation across micro-batches with DDP.no_sync()
- fp16 autocast + GradScaler
- wandb / checkpoints from rank 0 only

    torchrun --nproc_per_node=8 07_cremi_affinities_syncbn.py --data /nrs/cremi --run-name affs_syncbn_v2
"""
import argparse
import contextlib
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

OFFSETS = [(-1, 0, 0), (0, -1, 0), (0, 0, -1), (-2, 0, 0), (0, -3, 0), (0, 0, -3), (0, -9, 0), (0, 0, -9)]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run-name", required=True)
    p.add_argument("--ckpt-dir", default="/nrs/cremi/checkpoints")
    p.add_argument("--patch", type=int, nargs=3, default=[32, 196, 196])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--iters", type=int, default=200_000)
    p.add_argument("--epoch-len", type=int, default=4000, help="samples per 'epoch' per GPU")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def affinities(seg):
    affs = np.zeros((len(OFFSETS),) + seg.shape, dtype=np.float32)
    for i, off in enumerate(OFFSETS):
        a = [slice(None)] * 3
        b = [slice(None)] * 3
        for d, o in enumerate(off):
            if o < 0:
                a[d], b[d] = slice(-o, None), slice(None, o)
        sa, sb = seg[tuple(a)], seg[tuple(b)]
        affs[i][tuple(a)] = (sa == sb) & (sa > 0)
    return affs


class CremiPatches(Dataset):
    def __init__(self, files, patch, n, augment, seed):
        self.vols, self.segs = [], []
        for f in files:
            with h5py.File(f, "r") as h:
                self.vols.append(h["volumes/raw"][:])
                self.segs.append(h["volumes/labels/neuron_ids"][:].astype(np.int64))
        self.patch, self.n, self.augment = patch, n, augment
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        rng = np.random.default_rng((self.seed, idx, torch.initial_seed() % 2 ** 31))
        v = rng.integers(len(self.vols))
        raw, seg = self.vols[v], self.segs[v]
        o = [rng.integers(0, s - p + 1) for s, p in zip(raw.shape, self.patch)]
        sl = tuple(slice(a, a + p) for a, p in zip(o, self.patch))
        r = raw[sl].astype(np.float32) / 255.0
        s = seg[sl]
        if self.augment:
            if rng.random() < 0.5:
                r, s = r[:, ::-1], s[:, ::-1]
            if rng.random() < 0.5:
                r, s = r[:, :, ::-1], s[:, :, ::-1]
            if rng.random() < 0.5:
                r, s = r.transpose(0, 2, 1), s.transpose(0, 2, 1)
            r = np.clip(r * rng.uniform(0.9, 1.1) + rng.uniform(-0.1, 0.1), 0, 1)
        return torch.from_numpy(np.ascontiguousarray(r))[None], torch.from_numpy(affinities(np.ascontiguousarray(s)))


class ConvBlock(nn.Sequential):
    def __init__(self, i, o, k=(3, 3, 3)):
        pad = tuple(x // 2 for x in k)
        super().__init__(nn.Conv3d(i, o, k, padding=pad), nn.BatchNorm3d(o), nn.ReLU(inplace=True),
                         nn.Conv3d(o, o, k, padding=pad), nn.BatchNorm3d(o), nn.ReLU(inplace=True))


class AffUNet(nn.Module):
    def __init__(self, fmaps=12, inc=5, n_out=len(OFFSETS)):
        super().__init__()
        f = [fmaps * inc ** i for i in range(4)]
        self.l0 = ConvBlock(1, f[0], (1, 3, 3))
        self.l1 = ConvBlock(f[0], f[1], (1, 3, 3))
        self.l2 = ConvBlock(f[1], f[2])
        self.l3 = ConvBlock(f[2], f[3])
        self.r2 = ConvBlock(f[3] + f[2], f[2])
        self.r1 = ConvBlock(f[2] + f[1], f[1], (1, 3, 3))
        self.r0 = ConvBlock(f[1] + f[0], f[0], (1, 3, 3))
        self.out = nn.Conv3d(f[0], n_out, 1)
        self.factors = [(1, 3, 3), (1, 3, 3), (2, 2, 2)]

    def forward(self, x):
        x0 = self.l0(x)
        x1 = self.l1(F.max_pool3d(x0, self.factors[0]))
        x2 = self.l2(F.max_pool3d(x1, self.factors[1]))
        x3 = self.l3(F.max_pool3d(x2, self.factors[2]))
        y = self.r2(torch.cat([F.interpolate(x3, size=x2.shape[2:], mode="nearest"), x2], 1))
        y = self.r1(torch.cat([F.interpolate(y, size=x1.shape[2:], mode="nearest"), x1], 1))
        y = self.r0(torch.cat([F.interpolate(y, size=x0.shape[2:], mode="nearest"), x0], 1))
        return self.out(y)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)  # bce sum, correct voxels, voxels
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        logits = logits.float()
        acc[0] += F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
        acc[1] += ((logits > 0).float() == y).sum()
        acc[2] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    files = [os.path.join(args.data, f"sample_{s}_20160501.hdf") for s in "ABC"]
    train_ds = CremiPatches(files, args.patch, args.epoch_len * world, True, args.seed)
    val_ds = CremiPatches(files, args.patch, 32 * world, False, args.seed + 1000)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, args.micro_batch, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.micro_batch, num_workers=2)

    model = AffUNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.95, 0.999))
    warmup = 2000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda it: min(1.0, (it + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(it, args.iters) / args.iters)))
    scaler = torch.cuda.amp.GradScaler()

    ckpt_dir = os.path.join(args.ckpt_dir, args.run_name)
    ckpt_path = os.path.join(ckpt_dir, "latest.pt")
    it, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location={"cuda:0": f"cuda:{local_rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        it, epoch = ck["iter"], ck["epoch"]

    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        wandb.init(project="cremi-affs", name=args.run_name, config=vars(args), resume="allow")

    model.train()
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        micro = 0
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            last_micro = micro % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.binary_cross_entropy_with_logits(model(x), y) / args.accum
                scaler.scale(loss).backward()
            if not last_micro:
                continue
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            it += 1

            if it % 100 == 0 and rank == 0:
                wandb.log({"train/loss": loss.item() * args.accum, "lr": sched.get_last_lr()[0],
                           "it_per_s": 100 / (time.time() - t0)}, step=it)
                t0 = time.time()
            if it % args.eval_every == 0:
                vloss, vacc = validate(model, val_dl, device)
                if rank == 0:
                    wandb.log({"val/bce": vloss, "val/acc": vacc}, step=it)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                                "iter": it, "epoch": epoch}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "final_weights.pt"))
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
