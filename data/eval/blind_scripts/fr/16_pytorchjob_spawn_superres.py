"""EDSR x4 super-resolution for the microscopy archive.

apiVersion: kubeflow.org/v1
kind: PyTorchJob
spec:
  pytorchReplicaSpecs:
    Master: {replicas: 1, template: ... resources.limits: {nvidia.com/gpu: 8}}
    Worker: {replicas: 1, template: ... resources.limits: {nvidia.com/gpu: 8}}
  container command: ["python", "/workspace/sr_train.py", "--data", "/mnt/micro/patches",
                      "--out", "/mnt/shared/sr/edsr_x4"]

The operator gives every pod MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK; inside the
pod we start one process per GPU with torch.multiprocessing.
"""
import argparse
import glob
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=int, default=4)
    p.add_argument("--patch", type=int, default=48, help="LR patch size")
    p.add_argument("--n-resblocks", type=int, default=32)
    p.add_argument("--n-feats", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=300_000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--val-every", type=int, default=5000)
    return p.parse_args()


class PairedPatches(Dataset):
    def __init__(self, root, split, scale, patch, train):
        self.hr = sorted(glob.glob(os.path.join(root, split, "HR", "*.png")))
        self.lr = sorted(glob.glob(os.path.join(root, split, f"LR_x{scale}", "*.png")))
        assert len(self.hr) == len(self.lr)
        self.scale, self.patch, self.train = scale, patch, train

    def __len__(self):
        return len(self.hr)

    def __getitem__(self, i):
        hr = np.asarray(Image.open(self.hr[i]).convert("L"), dtype=np.float32) / 255.0
        lr = np.asarray(Image.open(self.lr[i]).convert("L"), dtype=np.float32) / 255.0
        if self.train:
            h, w = lr.shape
            y, x = random.randint(0, h - self.patch), random.randint(0, w - self.patch)
            lr = lr[y:y + self.patch, x:x + self.patch]
            s = self.scale
            hr = hr[y * s:(y + self.patch) * s, x * s:(x + self.patch) * s]
            if random.random() < 0.5:
                lr, hr = lr[:, ::-1], hr[:, ::-1]
            if random.random() < 0.5:
                lr, hr = lr.T, hr.T
        return torch.from_numpy(lr.copy())[None], torch.from_numpy(hr.copy())[None]


class ResBlock(nn.Module):
    def __init__(self, c, res_scale=0.1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(True), nn.Conv2d(c, c, 3, padding=1))
        self.res_scale = res_scale

    def forward(self, x):
        return x + self.body(x) * self.res_scale


class EDSR(nn.Module):
    def __init__(self, scale, n_resblocks, n_feats):
        super().__init__()
        self.head = nn.Conv2d(1, n_feats, 3, padding=1)
        self.body = nn.Sequential(*[ResBlock(n_feats) for _ in range(n_resblocks)],
                                  nn.Conv2d(n_feats, n_feats, 3, padding=1))
        up = []
        for _ in range(int(math.log2(scale))):
            up += [nn.Conv2d(n_feats, 4 * n_feats, 3, padding=1), nn.PixelShuffle(2)]
        self.tail = nn.Sequential(*up, nn.Conv2d(n_feats, 1, 3, padding=1))

    def forward(self, x):
        h = self.head(x)
        return self.tail(self.body(h) + h)


def psnr(sr, hr, shave):
    diff = (sr.clamp(0, 1) - hr)[..., shave:-shave, shave:-shave]
    mse = diff.pow(2).mean(dim=(1, 2, 3))
    return -10 * torch.log10(mse + 1e-10)


@torch.no_grad()
def validate(model, loader, device, scale):
    model.eval()
    acc = torch.zeros(2, device=device)
    for lr, hr in loader:
        lr, hr = lr.to(device), hr.to(device)
        acc[0] += psnr(model(lr), hr, scale).sum()
        acc[1] += lr.size(0)
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def worker(local_rank, ngpus, args):
    node_rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    rank = node_rank * ngpus + local_rank

    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_ds = PairedPatches(args.data, "train", args.scale, args.patch, train=True)
    val_ds = PairedPatches(args.data, "val", args.scale, args.patch, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                        batch_size=1, num_workers=2)

    model = EDSR(args.scale, args.n_resblocks, args.n_feats).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[200_000], gamma=0.5)

    os.makedirs(args.out, exist_ok=True)
    last = os.path.join(args.out, "last.pt")
    it, epoch, best = 0, 0, 0.0
    if os.path.exists(last):
        st = torch.load(last, map_location=device)
        model.module.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        it, epoch, best = st["iter"], st["epoch"], st["best"]

    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for lr, hr in train_dl:
            lr = lr.to(device, non_blocking=True)
            hr = hr.to(device, non_blocking=True)
            loss = F.l1_loss(model(lr), hr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                print(f"iter {it} l1 {loss.item():.5f} ({(time.time() - t0) / 200:.3f}s/it)", flush=True)
                t0 = time.time()
            if it % args.val_every == 0:
                val_psnr = validate(model, val_dl, device, args.scale)
                if rank == 0:
                    print(f"iter {it} val PSNR {val_psnr:.2f} dB", flush=True)
                    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                             "scheduler": scheduler.state_dict(), "iter": it, "epoch": epoch,
                             "best": max(best, val_psnr)}
                    torch.save(state, last + ".tmp")
                    os.replace(last + ".tmp", last)
                    if val_psnr > best:
                        torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                best = max(best, val_psnr)
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    ngpus = torch.cuda.device_count()
    mp.spawn(worker, args=(ngpus, args), nprocs=ngpus, join=True)
