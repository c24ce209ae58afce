#!/usr/bin/env python
"""
SchNet on QM9 (target: U0, eV), multi-node data parallel started directly by srun.

slurm/schnet_qm9.sbatch:

    #!/bin/bash
    #SBATCH --job-name=schnet-qm9
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=8
    #SBATCH --time=12:00:00
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29621
    srun python 10_schnet_qm9_srun.py --root /scratch/$USER/qm9 --epochs 400
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet

TARGET = 7   # U0


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/qm9")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--cutoff", type=float, default=10.0)
    p.add_argument("--ckpt", default="checkpoints/schnet_u0.pt")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def init_distributed(args):
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = args.local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
    )
    return rank, world_size, local_rank


def load_qm9(root, rank):
    # PyG downloads and processes on first use: let rank 0 do it, the rest wait
    if rank == 0:
        QM9(root)
    dist.barrier()
    ds = QM9(root)
    ds.data.y = ds.data.y[:, TARGET:TARGET + 1]
    return ds


def split(ds, seed=0):
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))
    n_train, n_val = 110_000, 10_000
    return ds[perm[:n_train]], ds[perm[n_train:n_train + n_val]], ds[perm[n_train + n_val:]]


@torch.no_grad()
def mae(model, loader, mean, std, device):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device)
        pred = model(data.z, data.pos, data.batch).squeeze(-1) * std + mean
        acc[0] += (pred - data.y.squeeze(-1)).abs().sum().double()
        acc[1] += data.num_graphs
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    rank, world, local_rank = init_distributed(args)
    device = torch.device("cuda", local_rank)

    ds = load_qm9(args.root, rank)
    train_ds, val_ds, test_ds = split(ds)
    y_train = train_ds.y.squeeze(-1)
    mean, std = y_train.mean().item(), y_train.std().item()

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=4)
    test_loader = DataLoader(test_ds, batch_size=256, sampler=test_sampler, num_workers=4)

    torch.manual_seed(1)
    model = SchNet(hidden_channels=128, num_filters=128, num_interactions=6,
                   num_gaussians=50, cutoff=args.cutoff).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=15, min_lr=1e-6)

    if rank == 0:
        print(f"world={world} train={len(train_ds)} val={len(val_ds)} test={len(test_ds)} "
              f"mean={mean:.3f} std={std:.3f}", flush=True)

    best_val = float("inf")
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred = model(data.z, data.pos, data.batch).squeeze(-1)
            loss = F.l1_loss(pred, (data.y.squeeze(-1) - mean) / std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            loss_sum += torch.stack([loss.detach() * data.num_graphs,
                                     torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(loss_sum)

        val_mae = mae(model, val_loader, mean, std, device)
        sched.step(val_mae)
        if rank == 0:
            print(f"epoch {epoch:4d} train_l1 {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val_MAE {val_mae * 1000:.1f} meV lr {opt.param_groups[0]['lr']:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if val_mae < best_val:
                best_val = val_mae
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "mean": mean, "std": std,
                            "epoch": epoch}, args.ckpt)
        dist.barrier()

    state = torch.load(args.ckpt, map_location=device)
    model.module.load_state_dict(state["model"])
    test_mae = mae(model, test_loader, mean, std, device)
    if rank == 0:
        print(f"best val {best_val * 1000:.1f} meV, test MAE {test_mae * 1000:.1f} meV", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
