#!/usr/bin/env python
"""SchNet on QM9 (internal energy U0) with DistributedDataParallel.

Usage:
    torchrun --standalone --nproc_per_node=4 01_qm9_schnet_u0.py \
        --data_root /datasets/qm9 --out_dir runs/schnet_u0
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet

U0_INDEX = 7  # PyG QM9 target column for U0 (eV)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", type=str, default="/datasets/qm9")
    p.add_argument("--out_dir", type=str, default="runs/schnet_u0")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=32, help="molecules per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min_lr", type=float, default=1e-6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--num_interactions", type=int, default=6)
    p.add_argument("--cutoff", type=float, default=10.0)
    p.add_argument("--n_train", type=int, default=110000)
    p.add_argument("--n_val", type=int, default=10000)
    p.add_argument("--split_seed", type=int, default=42)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def atom_statistics(subset, batch_size=2048):
    """Per-atom mean/std of U0 on the training split (SchNet scales the atomwise outputs)."""
    loader = DataLoader(subset, batch_size=batch_size, shuffle=False)
    per_atom = []
    for data in loader:
        natoms = torch.bincount(data.batch, minlength=data.num_graphs).float()
        per_atom.append(data.y[:, U0_INDEX] / natoms)
    per_atom = torch.cat(per_atom)
    return per_atom.mean().item(), per_atom.std().item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    abs_err = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device, non_blocking=True)
        pred = model(data.z, data.pos, data.batch).view(-1)
        target = data.y[:, U0_INDEX]
        abs_err += (pred - target).abs().sum().double()
        count += target.numel()
    dist.all_reduce(abs_err)
    dist.all_reduce(count)
    return (abs_err / count).item()


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_mae, stats):
    torch.save(
        {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best_mae": best_mae,
            "stats": stats,
        },
        path,
    )


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    if is_main:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    dataset = QM9(args.data_root)

    # Fixed split shared by all ranks.
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.split_seed))
    train_idx = perm[: args.n_train]
    val_idx = perm[args.n_train : args.n_train + args.n_val]
    train_set = Subset(dataset, train_idx.tolist())
    # each rank scores a disjoint slice of the validation molecules
    val_set = Subset(dataset, val_idx[rank::world_size].tolist())

    mean, std = atom_statistics(train_set)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.split_seed, drop_last=True)
    train_loader = DataLoader(
        train_set,
        batch_size=args.batch_size,
        sampler=train_sampler,
        num_workers=args.num_workers,
        pin_memory=True,
        persistent_workers=args.num_workers > 0,
    )
    val_loader = DataLoader(val_set, batch_size=128, shuffle=False, num_workers=2)

    model = SchNet(
        hidden_channels=args.hidden,
        num_filters=args.hidden,
        num_interactions=args.num_interactions,
        num_gaussians=50,
        cutoff=args.cutoff,
        max_num_neighbors=32,
        readout="add",
        mean=mean,
        std=std,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=0.8, patience=10, min_lr=args.min_lr
    )

    start_epoch, best_mae = 0, float("inf")
    last_path = os.path.join(args.out_dir, "last.pt")
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_mae = ckpt["epoch"] + 1, ckpt["best_mae"]
        if is_main:
            print(f"resumed from epoch {ckpt['epoch']} (best val MAE {best_mae * 1000:.2f} meV)")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred = model(data.z, data.pos, data.batch).view(-1)
            loss = F.l1_loss(pred, data.y[:, U0_INDEX])

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
            optimizer.step()

            running[0] += loss.detach() * data.num_graphs
            running[1] += data.num_graphs

        dist.all_reduce(running)
        train_mae = (running[0] / running[1]).item()
        val_mae = evaluate(model, val_loader, device)
        scheduler.step(val_mae)

        if is_main:
            lr = optimizer.param_groups[0]["lr"]
            print(
                f"epoch {epoch:4d} | train MAE {train_mae * 1000:8.2f} meV | "
                f"val MAE {val_mae * 1000:8.2f} meV | lr {lr:.2e} | {time.time() - t0:.0f}s",
                flush=True,
            )
            stats = {"mean": mean, "std": std}
            if val_mae < best_mae:
                best_mae = val_mae
                save_checkpoint(os.path.join(args.out_dir, "best.pt"), model, optimizer, scheduler, epoch, best_mae, stats)
            save_checkpoint(last_path, model, optimizer, scheduler, epoch, best_mae, stats)

        if optimizer.param_groups[0]["lr"] <= args.min_lr + 1e-12:
            if is_main:
                print("learning rate reached min_lr, stopping")
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
