"""ASL-DVS (24 hand-shape letters) with on-GPU voxelization of raw event batches.

The loader ships padded raw events (x, y, t, p) plus lengths; binning into
[T, 2, H, W] happens on the GPU, which is much faster than np.add.at in workers
for the ~100k recordings.

    torchrun --nproc_per_node=4 16_asldvs_gpu_voxelizer.py --data /data/tonic --T 8
"""
import argparse
import os
import time

import numpy as np
import tonic
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, random_split
from torch.utils.data.distributed import DistributedSampler

SENSOR_W, SENSOR_H = 240, 180


class PadEvents:
    """Collate variable-length event arrays into [B, N_max, 4] float32 + lengths."""

    def __init__(self, max_events=20000):
        self.max_events = max_events

    def __call__(self, batch):
        evs, ys = [], []
        for ev, y in batch:
            arr = np.stack([ev["x"], ev["y"], ev["t"], ev["p"]], axis=1).astype(np.float32)
            if len(arr) > self.max_events:
                keep = np.sort(np.random.choice(len(arr), self.max_events, replace=False))
                arr = arr[keep]
            evs.append(torch.from_numpy(arr))
            ys.append(y)
        lengths = torch.tensor([len(e) for e in evs])
        padded = torch.zeros(len(evs), int(lengths.max()), 4)
        for i, e in enumerate(evs):
            padded[i, : len(e)] = e
        return padded, lengths, torch.tensor(ys)


class EventVoxelizer:
    def __init__(self, bins, height, width, device="cuda:0"):
        self.bins, self.h, self.w = bins, height, width
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, ev, lengths):
        ev = ev.to(self.device, non_blocking=True)
        lengths = lengths.to(self.device, non_blocking=True)
        B, N, _ = ev.shape
        valid = torch.arange(N, device=self.device)[None, :] < lengths[:, None]
        x, y, t, p = ev.unbind(-1)
        t0 = t[:, :1]
        t1 = torch.where(valid, t, torch.full_like(t, -1)).amax(1, keepdim=True)
        tb = ((t - t0) / (t1 - t0 + 1.0) * self.bins).long().clamp_(0, self.bins - 1)
        b = torch.arange(B, device=self.device)[:, None].expand(B, N)
        flat = (((b * self.bins + tb) * 2 + p.long()) * self.h + y.long()) * self.w + x.long()
        vox = torch.zeros(B * self.bins * 2 * self.h * self.w, device=self.device)
        vox.index_add_(0, flat[valid], torch.ones_like(flat[valid], dtype=vox.dtype))
        vox = vox.view(B, self.bins, 2, self.h, self.w)
        return torch.log1p(vox)


class SG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return (u > 0).float()

    @staticmethod
    def backward(ctx, g):
        (u,) = ctx.saved_tensors
        s = torch.sigmoid(4 * u)
        return g * 4 * s * (1 - s)


def lif(cur, tau=2.0):
    v, out = torch.zeros_like(cur[0]), []
    for c in cur:
        v = v + (c - v) / tau
        s = SG.apply(v - 1.0)
        v = v - s
        out.append(s)
    return torch.stack(out)


class ASLNet(nn.Module):
    def __init__(self, num_classes=24):
        super().__init__()
        chans = [2, 32, 64, 128, 256]
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1, bias=False) for a, b in zip(chans, chans[1:]))
        self.norms = nn.ModuleList(nn.GroupNorm(8, b) for b in chans[1:])
        self.fc = nn.Linear(256, num_classes)

    def forward(self, vox):  # [B, T, 2, H, W]
        x = vox.transpose(0, 1)
        T, B = x.shape[:2]
        rates = []
        for conv, norm in zip(self.convs, self.norms):
            y = F.max_pool2d(norm(conv(x.flatten(0, 1))), 2)
            x = lif(y.view(T, B, *y.shape[1:]))
            rates.append(x.mean())
        return self.fc(x.mean(dim=(0, 3, 4))), torch.stack(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/tonic")
    ap.add_argument("--out", default="runs/asldvs")
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 256")
    ap.add_argument("--test-frac", type=float, default=0.2)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        tonic.datasets.ASLDVS(save_to=args.data)
    dist.barrier()
    full = tonic.datasets.ASLDVS(save_to=args.data)
    n_test = int(len(full) * args.test_frac)
    # the generator is seeded identically everywhere, so every rank sees the same split
    train_set, test_set = random_split(full, [len(full) - n_test, n_test],
                                       generator=torch.Generator().manual_seed(0))

    collate = PadEvents()
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 128,
                             collate_fn=collate, num_workers=8, pin_memory=True)
    voxelize = EventVoxelizer(args.T, SENSOR_H, SENSOR_W)

    model = DDP(ASLNet().to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc_loss = torch.zeros(2, device=device)
        for it, (ev, lengths, y) in enumerate(train_loader):
            vox = voxelize(ev, lengths)
            y = y.to(device, non_blocking=True)
            logits, rates = model(vox)
            loss = F.cross_entropy(logits, y) + 0.1 * F.relu(rates - 0.2).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            acc_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and it % 200 == 0:
                print(f"  ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"rates {[round(r, 3) for r in rates.tolist()]}", flush=True)
        dist.all_reduce(acc_loss)

        net = model.module.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for ev, lengths, y in test_loader:
                logits, _ = net(voxelize(ev, lengths))
                hits[0] += (logits.argmax(1) == y.to(device)).sum()
                hits[1] += y.numel()
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()

        if rank == 0:
            print(f"epoch {epoch} loss {acc_loss[0] / acc_loss[1]:.4f} test acc {acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
