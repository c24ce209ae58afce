"""Spatially decomposed training of a local convolutional surrogate for 2D
incompressible Navier-Stokes (vorticity form) at 2048^2.

One field does not fit comfortably on one GPU together with the activations, so each
rank owns a horizontal slab of rows of every sample. Convolutions see their
neighbours' rows through a differentiable halo exchange; the y direction is
periodic and local to the slab. All ranks process the SAME samples in the same
order (this is domain decomposition, not data parallelism), and the parameter
gradients are summed over the slabs by hand.

    torchrun --standalone --nproc_per_node=4 03_ns2d_domain_decomp.py --data /data/ns2d/ns_2048_re5000.h5
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="HDF5 with dataset 'w' of shape [N, T, H, W]")
    p.add_argument("--n-train", type=int, default=180)
    p.add_argument("--n-test", type=int, default=20)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--rollout", type=int, default=10)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--ckpt-dir", default="ckpt/ns2d_dd")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


# ----------------------------------------------------------------------------------
# halo exchange along rows (dim -2), periodic
# ----------------------------------------------------------------------------------
class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h):
        ctx.h = h
        rank, world = dist.get_rank(), dist.get_world_size()
        up, down = (rank - 1) % world, (rank + 1) % world
        top = torch.empty_like(x[..., :h, :])
        bot = torch.empty_like(x[..., -h:, :])
        # sends are posted [up, down] and receives [down, up] so that the pairs still
        # match in order when up == down (two ranks)
        ops = [
            dist.P2POp(dist.isend, x[..., :h, :].contiguous(), up),
            dist.P2POp(dist.irecv, bot, down),
            dist.P2POp(dist.isend, x[..., -h:, :].contiguous(), down),
            dist.P2POp(dist.irecv, top, up),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return torch.cat([top, x, bot], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        h = ctx.h
        rank, world = dist.get_rank(), dist.get_world_size()
        up, down = (rank - 1) % world, (rank + 1) % world
        g_top, g_mid, g_bot = grad[..., :h, :], grad[..., h:-h, :], grad[..., -h:, :]
        from_down = torch.empty_like(g_bot)
        from_up = torch.empty_like(g_top)
        ops = [
            dist.P2POp(dist.isend, g_top.contiguous(), up),
            dist.P2POp(dist.irecv, from_down, down),
            dist.P2POp(dist.isend, g_bot.contiguous(), down),
            dist.P2POp(dist.irecv, from_up, up),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        g = g_mid.clone()
        g[..., -h:, :] += from_down
        g[..., :h, :] += from_up
        return g, None


def halo_exchange(x, h):
    if dist.get_world_size() == 1:
        return torch.cat([x[..., -h:, :], x, x[..., :h, :]], dim=-2)
    return _HaloExchange.apply(x, h)


class SlabConv(nn.Module):
    """3x3 conv on a row slab: halo rows from neighbours, circular padding in y."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=0)

    def forward(self, x):
        x = halo_exchange(x, 1)
        x = F.pad(x, (1, 1, 0, 0), mode="circular")
        return self.conv(x)


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = SlabConv(c, c)
        self.c2 = SlabConv(c, c)

    def forward(self, x):
        return x + self.c2(F.gelu(self.c1(F.gelu(x))))


class LocalSurrogate(nn.Module):
    def __init__(self, width, blocks):
        super().__init__()
        self.enc = SlabConv(1, width)
        self.blocks = nn.Sequential(*[ResBlock(width) for _ in range(blocks)])
        self.dec = nn.Conv2d(width, 1, 1)

    def forward(self, w):
        return w + self.dec(F.gelu(self.blocks(self.enc(w))))


# ----------------------------------------------------------------------------------
# data: every rank reads its own rows of the same samples
# ----------------------------------------------------------------------------------
class SlabPairs(Dataset):
    def __init__(self, path, sample_ids, row0, row1, stride=1):
        self.path, self.row0, self.row1 = path, row0, row1
        with h5py.File(path, "r") as f:
            T = f["w"].shape[1]
        self.items = [(n, t) for n in sample_ids for t in range(0, T - 1, stride)]
        self.f = None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        n, t = self.items[i]
        pair = self.f["w"][n, t:t + 2, self.row0:self.row1, :].astype(np.float32)
        return torch.from_numpy(pair[0:1]), torch.from_numpy(pair[1:2])


class SharedPermutation(Sampler):
    """Same permutation on every rank (seeded by epoch)."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


def allreduce_grads(model, world):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


@torch.no_grad()
def evaluate(model, path, test_ids, row0, row1, steps, device):
    num = torch.zeros(steps, device=device, dtype=torch.float64)
    den = torch.zeros(steps, device=device, dtype=torch.float64)
    with h5py.File(path, "r") as f:
        for n in test_ids:
            traj = torch.from_numpy(f["w"][n, : steps + 1, row0:row1, :].astype(np.float32)).to(device)
            w = traj[0:1].unsqueeze(0)
            for k in range(steps):
                w = model(w)
                num[k] += ((w[0, 0] - traj[k + 1]) ** 2).sum()
                den[k] += (traj[k + 1] ** 2).sum()
    dist.all_reduce(num)
    dist.all_reduce(den)
    return (num / den).sqrt()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with h5py.File(args.data, "r") as f:
        N, T, H, W = f["w"].shape
    assert H % world == 0, f"H={H} must be divisible by world size {world}"
    rows = H // world
    row0, row1 = rank * rows, (rank + 1) * rows

    train_ids = list(range(args.n_train))
    test_ids = list(range(N - args.n_test, N))
    ds = SlabPairs(args.data, train_ids, row0, row1)
    sampler = SharedPermutation(len(ds), args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = LocalSurrogate(args.width, args.blocks).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader))

    ckpt_path = os.path.join(args.ckpt_dir, "latest.pt")
    start = 0
    if args.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{world} slabs of {rows}x{W}, {len(ds)} training pairs", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        for w0, w1 in loader:
            w0, w1 = w0.to(device, non_blocking=True), w1.to(device, non_blocking=True)
            pred = model(w0)
            loss = F.mse_loss(pred, w1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(model, world)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach().double(), torch.ones((), device=device, dtype=torch.float64)])
        dist.all_reduce(acc)

        model.eval()
        err = evaluate(model, args.data, test_ids, row0, row1, args.rollout, device)
        if rank == 0:
            print(f"epoch {epoch:3d} {time.time() - tic:7.1f}s  mse {acc[0].item() / acc[1].item():.3e}  "
                  f"rel-L2 t+1 {err[0].item():.4f}  t+{args.rollout} {err[-1].item():.4f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
