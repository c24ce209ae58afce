"""DeepONet for the 1D linear advection equation with variable initial profiles.

    u_t + c u_x = 0 on [0, 1] periodic, operator: u(., 0) -> u(x, t) on [0, 1] x [0, 1].

Started with torch.multiprocessing on one node (the cluster's interactive nodes have no
torchrun wrapper):

    python 16_deeponet_advection_spawn.py --data data/advection_c1.npz --gpus 4 --accum 2
"""
import argparse
import math
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--n-query", type=int, default=256, help="query points per function per step")
    p.add_argument("--latent", type=int, default=100)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32, help="functions per GPU per micro-batch")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--base-lr", type=float, default=5e-4, help="for 1 GPU, accum 1; scaled linearly")
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--ckpt", default="checkpoints/deeponet_adv.pt")
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class AdvectionData(Dataset):
    def __init__(self, path, split, n_query=None):
        d = np.load(path)
        self.u0 = torch.tensor(d[f"{split}_u0"], dtype=torch.float32)       # (N, m) sensor values
        self.sol = torch.tensor(d[f"{split}_u"], dtype=torch.float32)       # (N, nt, nx)
        nt, nx = self.sol.shape[1:]
        t, x = torch.meshgrid(torch.linspace(0, 1, nt), torch.linspace(0, 1, nx), indexing="ij")
        self.xt = torch.stack([x.reshape(-1), t.reshape(-1)], dim=1)        # (nt*nx, 2)
        self.n_query = n_query

    def __len__(self):
        return self.u0.shape[0]

    def __getitem__(self, i):
        s = self.sol[i].reshape(-1)
        if self.n_query is None:
            return self.u0[i], self.xt, s
        idx = torch.randperm(s.shape[0])[: self.n_query]
        return self.u0[i], self.xt[idx], s[idx]


class DeepONet(nn.Module):
    def __init__(self, m, hidden, latent):
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(m, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                    nn.Linear(hidden, latent))
        # periodic trunk features in x
        self.trunk = nn.Sequential(nn.Linear(3, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                   nn.Linear(hidden, latent), nn.GELU())
        self.b0 = nn.Parameter(torch.zeros(1))

    def forward(self, u0, xt):
        x, t = xt[..., :1], xt[..., 1:]
        feats = torch.cat([torch.sin(2 * math.pi * x), torch.cos(2 * math.pi * x), t], dim=-1)
        return torch.einsum("bl,bql->bq", self.branch(u0), self.trunk(feats)) + self.b0


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    train = AdvectionData(args.data, "train", args.n_query)
    test = AdvectionData(args.data, "test")
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                              drop_last=True, persistent_workers=True)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world_size)), batch_size=16)

    model = DDP(DeepONet(train.u0.shape[1], args.hidden, args.latent).to(device), device_ids=[rank])
    # global batch = batch_size * accum * world_size functions
    lr = args.base_lr * world_size * args.accum
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    updates_per_epoch = len(train_loader) // args.accum
    total = args.epochs * updates_per_epoch
    warmup = min(500, total // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    start_epoch = 0
    if os.path.exists(args.ckpt):
        # saved from rank 0's GPU; remap onto this process's GPU
        ck = torch.load(args.ckpt, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        run = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for i, (u0, xt, s) in enumerate(train_loader):
            if i >= updates_per_epoch * args.accum:
                break
            u0, xt, s = u0.to(device), xt.to(device), s.to(device)
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                loss = nn.functional.mse_loss(model(u0, xt), s) / args.accum
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                with model.no_sync():
                    loss = nn.functional.mse_loss(model(u0, xt), s) / args.accum
                    loss.backward()
            run += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])

        model.eval()
        err = torch.zeros(2, device=device)
        with torch.no_grad():
            for u0, xt, s in test_loader:
                u0, xt, s = u0.to(device), xt.to(device), s.to(device)
                pred = model.module(u0, xt)
                err += torch.stack([(torch.linalg.norm(pred - s, dim=1) / torch.linalg.norm(s, dim=1)).sum(),
                                    torch.tensor(float(u0.shape[0]), device=device)])
        dist.all_reduce(run)
        dist.all_reduce(err)

        if rank == 0:
            if epoch % 10 == 0 or epoch == args.epochs - 1:
                print(f"epoch {epoch:4d} | {time.time() - tic:.1f}s | mse {(run[0] / run[1]).item():.3e} | "
                      f"test rel L2 {(err[0] / err[1]).item():.4f} | lr {scheduler.get_last_lr()[0]:.2e}",
                      flush=True)
            os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, args.ckpt + ".tmp")
            os.replace(args.ckpt + ".tmp", args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
