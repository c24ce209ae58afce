"""N-CARS (car / background) from exponential time surfaces with a LIF CNN.

Each 100 ms sample is cut into T slices; every slice becomes a 2-channel time
surface exp(-(t_slice_end - t_last_event) / tau) at 100 x 120.

Layout: <root>/{train,test}/{cars,background}/obj_XXXXXX_td.npy  (N x 4: t[us], x, y, p)

    torchrun --nproc_per_node=4 13_ncars_time_surface.py --root /data/ncars_npy
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

H, W = 100, 120
CLASSES = ("background", "cars")
log = logging.getLogger("ncars")


def time_surfaces(ev, T, tau_us=20_000.0, duration_us=100_000):
    surf = np.zeros((T, 2, H, W), dtype=np.float32)
    if len(ev) == 0:
        return surf
    t = ev[:, 0] - ev[0, 0]
    x = np.clip(ev[:, 1].astype(np.int64), 0, W - 1)
    y = np.clip(ev[:, 2].astype(np.int64), 0, H - 1)
    p = (ev[:, 3] > 0).astype(np.int64)
    last = np.full((2, H, W), -np.inf, dtype=np.float64)
    edges = np.linspace(0, duration_us, T + 1)
    start = 0
    for k in range(T):
        stop = np.searchsorted(t, edges[k + 1], side="right")
        # events are time ordered, so the last write per pixel is the latest timestamp
        last[p[start:stop], y[start:stop], x[start:stop]] = t[start:stop]
        surf[k] = np.exp(-(edges[k + 1] - last) / tau_us)
        start = stop
    return surf


class NCars(Dataset):
    def __init__(self, root, split, T):
        self.items = []
        for ci, c in enumerate(CLASSES):
            for f in sorted(glob.glob(os.path.join(root, split, c, "*.npy"))):
                self.items.append((f, ci))
        self.T = T

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, label = self.items[i]
        ev = np.load(f)
        return torch.from_numpy(time_surfaces(ev, self.T)), label, len(ev)


class SurrogateHeaviside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.gt(0).float()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 0.5 / (1 + (2 * x).pow(2))


class LIFConvBlock(nn.Module):
    def __init__(self, c_in, c_out, decay=0.5):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.decay = decay

    def forward(self, x):  # [T, B, C, H, W]
        T, B = x.shape[:2]
        cur = self.bn(self.conv(x.flatten(0, 1)))
        cur = F.avg_pool2d(cur, 2).view(T, B, -1, cur.shape[-2] // 2, cur.shape[-1] // 2)
        mem, out = torch.zeros_like(cur[0]), []
        for c in cur:
            mem = self.decay * mem + c
            s = SurrogateHeaviside.apply(mem - 0.5)
            mem = mem * (1 - s)
            out.append(s)
        return torch.stack(out)


class CarNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(LIFConvBlock(2, 32), LIFConvBlock(32, 64), LIFConvBlock(64, 128))
        self.fc = nn.Linear(128, len(CLASSES))

    def forward(self, x):  # [B, T, 2, H, W]
        s = self.blocks(x.transpose(0, 1))
        return self.fc(s.mean(dim=(0, 3, 4))), s.mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-events", type=int, default=300, help="recordings with fewer events carry no signal")
    ap.add_argument("--rate-coef", type=float, default=0.1)
    ap.add_argument("--out", default="runs/ncars_ts")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    train_set, test_set = NCars(args.root, "train", args.T), NCars(args.root, "test", args.T)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False, drop_last=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 128, sampler=test_sampler, num_workers=8, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(CarNet()).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world * args.batch_size / 64
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, y, n_ev in train_loader:
            keep = n_ev >= args.min_events
            if not keep.any():
                continue
            x = x[keep].to(device, non_blocking=True)
            y = y[keep].to(device, non_blocking=True)
            logits, rate = model(x)
            loss = F.cross_entropy(logits, y) + args.rate_coef * F.relu(rate - 0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            stats += torch.stack([loss.detach() * len(y), (logits.argmax(1) == y).sum().float(),
                                  torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(stats)

        # test: every sample counts, including near-empty ones; the sampler's padded repeats are dropped
        model.eval()
        hits = torch.zeros(2, device=device)
        pos = 0
        with torch.no_grad():
            for x, y, _ in test_loader:
                logits, _ = model.module(x.to(device, non_blocking=True))
                ok = logits.argmax(1).cpu() == y
                # with shuffle=False, local sample k sits at position k * world + rank of the padded list
                real = (torch.arange(pos, pos + len(y)) * world + rank) < len(test_set)
                hits[0] += ok[real].sum().item()
                hits[1] += real.sum().item()
                pos += len(y)
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()

        log.info("epoch %d loss %.4f train acc %.4f test acc %.4f (%d) %.0fs", epoch,
                 (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item(), acc, int(hits[1]), time.time() - t0)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
