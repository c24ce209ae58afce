"""N-MNIST, LIF conv net on cached voxel grids, gradient accumulation over micro-batches.

    torchrun --nproc_per_node=8 08_nmnist_sharded_cache_accum.py --raw /data/N-MNIST --cache /shared/cache/nmnist
"""
import argparse
import contextlib
import datetime
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def load_bin(path):
    ev = np.fromfile(path, dtype=np.uint8).reshape(-1, 5).astype(np.int64)
    x, y = ev[:, 0], ev[:, 1]
    p = ev[:, 2] >> 7
    t = ((ev[:, 2] & 0x7F) << 16) | (ev[:, 3] << 8) | ev[:, 4]
    return x, y, p, t


def voxelize(x, y, p, t, bins):
    """Bilinear-in-time voxel grid (Zhu et al.), polarity as +-1, shape [bins, 34, 34]."""
    grid = np.zeros((bins, 34, 34), dtype=np.float32)
    if len(t) < 2:
        return grid
    tn = (t - t[0]) / max(t[-1] - t[0], 1) * (bins - 1)
    t0 = np.floor(tn).astype(np.int64)
    w1 = tn - t0
    pol = 2.0 * p - 1.0
    np.add.at(grid, (t0, y, x), pol * (1 - w1))
    valid = t0 + 1 < bins
    np.add.at(grid, (t0[valid] + 1, y[valid], x[valid]), pol[valid] * w1[valid])
    return grid


class VoxelCache(Dataset):
    def __init__(self, raw_root, cache_root, split, bins):
        self.raw = sorted(glob.glob(os.path.join(raw_root, split, "*", "*.bin")))
        self.targets = [int(os.path.basename(os.path.dirname(f))) for f in self.raw]
        self.dir = os.path.join(cache_root, f"{split}_b{bins}")
        self.bins = bins

    def path(self, i):
        return os.path.join(self.dir, f"{i:05d}.npy")

    def build(self, rank, world):
        """Each rank converts a disjoint slice; files are renamed into place when complete."""
        os.makedirs(self.dir, exist_ok=True)
        for i in range(rank, len(self.raw), world):
            dst = self.path(i)
            if os.path.exists(dst):
                continue
            tmp = f"{dst}.{rank}.tmp.npy"
            np.save(tmp, voxelize(*load_bin(self.raw[i]), self.bins))
            os.replace(tmp, dst)

    def __len__(self):
        return len(self.raw)

    def __getitem__(self, i):
        return torch.from_numpy(np.load(self.path(i))), self.targets[i]


class TriangleSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return (v >= 0).float()

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        return g * F.relu(1.0 - v.abs())


def lif_seq(currents, decay, v_th=1.0):
    """currents: [T, B, ...] -> spikes [T, B, ...]; membrane starts from rest for every batch."""
    v = torch.zeros_like(currents[0])
    out = []
    for c in currents:
        v = decay * v + c
        s = TriangleSpike.apply(v - v_th)
        v = v - s * v_th
        out.append(s)
    return torch.stack(out)


class VoxelSNN(nn.Module):
    def __init__(self, decay=0.6):
        super().__init__()
        self.decay = decay
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc = nn.Linear(64 * 8 * 8, 10)

    def forward(self, vox):  # [B, bins, 34, 34]
        x = vox.transpose(0, 1).unsqueeze(2)  # [T, B, 1, 34, 34]
        T, B = x.shape[:2]
        s1 = lif_seq(self.conv1(x.flatten(0, 1)).view(T, B, 32, 34, 34), self.decay)
        s1 = F.max_pool2d(s1.flatten(0, 1), 2)
        s2 = lif_seq(self.conv2(s1).view(T, B, 64, 17, 17), self.decay)
        s2 = F.max_pool2d(s2.flatten(0, 1), 2).view(T, B, -1)
        logits = self.fc(s2).mean(0)
        return logits, 0.5 * (s1.mean() + s2.mean())


@torch.no_grad()
def evaluate(net, loader, device, n_total):
    """Per-sample hits gathered from all ranks, padding from DistributedSampler trimmed off."""
    net.eval()
    hits = []
    for vox, y in loader:
        logits, _ = net(vox.to(device, non_blocking=True))
        hits.append((logits.argmax(1) == y.to(device)).float())
    hits = torch.cat(hits)
    gathered = [torch.empty_like(hits) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, hits)
    # sampler (shuffle=False) gives rank r the padded positions r, r+W, r+2W, ...
    ordered = torch.stack(gathered, dim=1).flatten()[:n_total]
    return ordered.mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw", required=True)
    ap.add_argument("--cache", required=True, help="must be on storage every node sees")
    ap.add_argument("--bins", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-4, help="for global batch 512")
    ap.add_argument("--rate-target", type=float, default=0.1)
    ap.add_argument("--save", default="ckpt/nmnist_voxel.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # building the cache can take a while on the first run
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = VoxelCache(args.raw, args.cache, "Train", args.bins)
    test_set = VoxelCache(args.raw, args.cache, "Test", args.bins)
    t0 = time.time()
    train_set.build(rank, world)
    test_set.build(rank, world)
    dist.barrier()
    if rank == 0:
        print(f"cache ready ({time.time() - t0:.0f}s)", flush=True)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=7)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.micro_batch, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, 256, sampler=test_sampler, num_workers=6, pin_memory=True)

    model = DDP(VoxelSNN().to(device), device_ids=[local_rank])
    global_batch = args.micro_batch * args.accum * world
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * global_batch / 512)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[15, 22], gamma=0.1)

    start = 0
    if os.path.exists(args.save):
        ck = torch.load(args.save, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    usable = len(train_loader) // args.accum * args.accum
    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(1, device=device)
        opt.zero_grad(set_to_none=True)
        for i, (vox, y) in enumerate(train_loader):
            if i >= usable:
                break
            vox, y = vox.to(device, non_blocking=True), y.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0
            # skip the gradient all-reduce on all but the last micro-batch
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                logits, rate = model(vox)
                loss = F.cross_entropy(logits, y) + 0.5 * (rate - args.rate_target) ** 2
                (loss / args.accum).backward()
            if boundary:
                opt.step()
                opt.zero_grad(set_to_none=True)
            loss_acc += loss.detach()
        sched.step()
        dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)

        acc = evaluate(model.module, test_loader, device, len(test_set))
        if rank == 0:
            print(f"epoch {epoch}: loss {loss_acc.item() / usable:.4f}  test acc {acc:.4f}", flush=True)
            os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "acc": acc}, args.save + ".tmp")
            os.replace(args.save + ".tmp", args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
