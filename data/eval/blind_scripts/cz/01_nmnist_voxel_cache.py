#!/usr/bin/env python3
"""N-MNIST classification with a small convolutional LIF network.

The raw .bin recordings are binned once into voxel grids (T x 2 x 34 x 34) and
cached as .npy files, so the later epochs only have to np.load a float array.

    torchrun --nproc_per_node=4 01_nmnist_voxel_cache.py --data-root /data/N-MNIST
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SENSOR_HW = (34, 34)
log = logging.getLogger("nmnist")


# --------------------------------------------------------------------------- data
def read_nmnist_bin(path):
    """Orchard et al. format: 40 bits per event (x, y, polarity, 23-bit timestamp)."""
    raw = np.fromfile(path, dtype=np.uint8).astype(np.uint32)
    x = raw[0::5]
    y = raw[1::5]
    p = (raw[2::5] & 128) >> 7
    ts = ((raw[2::5] & 127) << 16) | (raw[3::5] << 8) | raw[4::5]
    return x, y, p, ts


def events_to_voxel(x, y, p, ts, bins, height, width):
    voxel = np.zeros((bins, 2, height, width), dtype=np.float32)
    if ts.size == 0:
        return voxel
    span = max(int(ts[-1]) - int(ts[0]), 1)
    b = ((ts - ts[0]).astype(np.int64) * bins) // (span + 1)
    np.add.at(voxel, (b, p.astype(np.int64), y.astype(np.int64), x.astype(np.int64)), 1.0)
    # log-scale the counts, saccades produce very bursty bins
    return np.log1p(voxel)


class NMNISTVoxels(Dataset):
    def __init__(self, root, split, cache_root, bins):
        self.bins = bins
        self.files = sorted(glob.glob(os.path.join(root, split, "*", "*.bin")))
        if not self.files:
            raise FileNotFoundError(f"no .bin files under {root}/{split}")
        self.labels = [int(os.path.basename(os.path.dirname(f))) for f in self.files]
        self.cache_dir = os.path.join(cache_root, f"{split.lower()}_T{bins}")
        self.cache_files = [os.path.join(self.cache_dir, f"{i:06d}.npy") for i in range(len(self.files))]

    def build_cache(self):
        os.makedirs(self.cache_dir, exist_ok=True)
        for src, dst in zip(self.files, self.cache_files):
            if os.path.exists(dst):
                continue
            vox = events_to_voxel(*read_nmnist_bin(src), self.bins, *SENSOR_HW)
            np.save(dst, vox)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        vox = np.load(self.cache_files[idx])
        return torch.from_numpy(vox), self.labels[idx]


# -------------------------------------------------------------------------- model
class FastSigmoidSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, slope):
        ctx.save_for_backward(v)
        ctx.slope = slope
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (v,) = ctx.saved_tensors
        grad = grad_out / (ctx.slope * v.abs() + 1.0) ** 2
        return grad, None


class LIF(nn.Module):
    """Multi-step LIF over the leading time dim; membrane starts at 0 for every call."""

    def __init__(self, tau=2.0, v_th=1.0, slope=10.0):
        super().__init__()
        self.decay = 1.0 - 1.0 / tau
        self.v_th = v_th
        self.slope = slope

    def forward(self, x_seq):
        v = torch.zeros_like(x_seq[0])
        spikes = []
        for x in x_seq:
            v = self.decay * v + x
            s = FastSigmoidSpike.apply(v - self.v_th, self.slope)
            v = v - s * self.v_th  # soft reset
            spikes.append(s)
        return torch.stack(spikes)


def over_time(module, x_seq):
    T, B = x_seq.shape[:2]
    y = module(x_seq.flatten(0, 1))
    return y.view(T, B, *y.shape[1:])


class ConvSNN(nn.Module):
    def __init__(self, tau, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 256)
        self.fc2 = nn.Linear(256, num_classes)
        self.lif1, self.lif2, self.lif3 = LIF(tau), LIF(tau), LIF(tau)

    def forward(self, x):
        x = x.transpose(0, 1)  # [B,T,2,H,W] -> [T,B,2,H,W]
        s1 = self.lif1(over_time(self.conv1, x))
        s1 = over_time(lambda t: F.max_pool2d(t, 2), s1)
        s2 = self.lif2(over_time(self.conv2, s1))
        s2 = over_time(lambda t: F.max_pool2d(t, 2), s2)
        s3 = self.lif3(over_time(self.fc1, s2.flatten(2)))
        logits = over_time(self.fc2, s3).mean(0)  # non-spiking readout averaged over T
        rates = torch.stack([s1.mean(), s2.mean(), s3.mean()])
        return logits, rates


# --------------------------------------------------------------------------- main
def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", required=True)
    p.add_argument("--cache-root", default="/scratch/nmnist_cache")
    p.add_argument("--out-dir", default="runs/nmnist")
    p.add_argument("--time-bins", type=int, default=10)
    p.add_argument("--tau", type=float, default=2.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 128")
    p.add_argument("--rate-target", type=float, default=0.05)
    p.add_argument("--rate-weight", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", default="")
    return p.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, count
    for vox, y in loader:
        vox, y = vox.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits, _ = net(vox)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)

    train_set = NMNISTVoxels(args.data_root, "Train", args.cache_root, args.time_bins)
    test_set = NMNISTVoxels(args.data_root, "Test", args.cache_root, args.time_bins)
    t0 = time.time()
    for ds in (train_set, test_set):
        ds.build_cache()
    log.info("voxel cache ready in %.1fs", time.time() - t0)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=1234, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # strided shard without padding, so every test sample is counted exactly once
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    test_loader = DataLoader(test_shard, batch_size=2 * args.batch_size, shuffle=False,
                             num_workers=args.workers, pin_memory=True)

    model = ConvSNN(args.tau).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]
        log.info("resumed from %s (epoch %d)", args.resume, ckpt["epoch"])

    os.makedirs(args.out_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        tic = time.time()
        for step, (vox, y) in enumerate(train_loader):
            vox, y = vox.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, rates = model(vox)
            ce = F.cross_entropy(logits, y)
            reg = ((rates - args.rate_target) ** 2).sum()
            loss = ce + args.rate_weight * reg
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            running += torch.stack([ce.detach(), rates.mean().detach()])
            if step % 100 == 0:
                log.info("ep %d it %d ce %.4f rate %.4f", epoch, step, ce.item(), rates.mean().item())
        scheduler.step()
        dist.all_reduce(running)
        running /= world_size * max(len(train_loader), 1)

        val_loss, val_acc = evaluate(model.module, test_loader, device)
        log.info("epoch %d | train ce %.4f rate %.4f | test loss %.4f acc %.4f | %.0fs",
                 epoch, running[0].item(), running[1].item(), val_loss, val_acc, time.time() - tic)

        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch,
                     "best_acc": max(best_acc, val_acc), "args": vars(args)}
            torch.save(state, os.path.join(args.out_dir, "last.pt"))
            if val_acc > best_acc:
                torch.save(state, os.path.join(args.out_dir, "best.pt"))
        best_acc = max(best_acc, val_acc)

    log.info("best test acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
