#!/usr/bin/env python
"""SchNet energy + force training on MD17 (aspirin) with DDP.

Forces are obtained as the negative gradient of the predicted energy w.r.t.
atomic positions, so the force loss is a second-order term in the parameters.

Usage:
    torchrun --standalone --nproc_per_node=4 03_schnet_md17_forces.py --molecule aspirin
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
from torch_geometric.datasets import MD17
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/scratch/shared/datasets/md17")
    p.add_argument("--molecule", default="aspirin")
    p.add_argument("--n-train", type=int, default=950)
    p.add_argument("--n-val", type=int, default=50)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--filters", type=int, default=128)
    p.add_argument("--interactions", type=int, default=6)
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=8, help="molecules per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=3000)
    p.add_argument("--rho-energy", type=float, default=0.01, help="weight of the energy term")
    p.add_argument("--out", default="/scratch/shared/runs/schnet_md17")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return dist.get_rank(), dist.get_world_size(), local_rank


def energy_and_forces(model, data, e_mean):
    pos = data.pos.requires_grad_(True)
    energy = model(data.z, pos, data.batch).squeeze(-1) + e_mean
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=model.training)[0]
    return energy, forces


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    # different seeds per rank are fine: DDP broadcasts rank 0's weights at construction
    torch.manual_seed(args.seed + rank)

    if rank == 0:
        MD17(args.root, name=f"revised {args.molecule}")  # download / process once
    dist.barrier()
    dataset = MD17(args.root, name=f"revised {args.molecule}")

    # identical split on every rank
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(dataset), generator=g)
    train_idx = perm[: args.n_train].tolist()
    val_idx = perm[args.n_train: args.n_train + args.n_val].tolist()
    train_set = Subset(dataset, train_idx)
    val_set = Subset(dataset, val_idx[rank::world_size])

    # mean energy of the training split, used as offset
    e_mean = torch.stack([dataset[i].energy for i in train_idx]).mean().to(device)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=32, shuffle=False, num_workers=2)

    model = SchNet(hidden_channels=args.hidden, num_filters=args.filters,
                   num_interactions=args.interactions, cutoff=args.cutoff).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.8, patience=50, min_lr=1e-6)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_val = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        t0 = time.time()
        acc = torch.zeros(3, device=device)
        for data in train_loader:
            data = data.to(device)
            energy, forces = energy_and_forces(ddp_model, data, e_mean)
            loss_e = F.mse_loss(energy, data.energy.view(-1))
            loss_f = F.mse_loss(forces, data.force)
            loss = args.rho_energy * loss_e + (1 - args.rho_energy) * loss_f
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            acc += torch.stack([loss_e.detach(), loss_f.detach(), torch.ones((), device=device)])

        # validation on this rank's shard (no padding), totals reduced below
        model.eval()
        val = torch.zeros(4, device=device)  # sum |dE|, n_mol, sum |dF|, n_force_components
        for data in val_loader:
            data = data.to(device)
            energy, forces = energy_and_forces(model, data, e_mean)
            val[0] += (energy.detach() - data.energy.view(-1)).abs().sum()
            val[1] += data.num_graphs
            val[2] += (forces.detach() - data.force).abs().sum()
            val[3] += data.force.numel()
        dist.all_reduce(val)
        dist.all_reduce(acc)
        e_mae, f_mae = (val[0] / val[1]).item(), (val[2] / val[3]).item()
        scheduler.step(f_mae)

        if rank == 0 and epoch % 10 == 0:
            print(f"epoch {epoch:5d}  train E {acc[0] / acc[2]:.4f} F {acc[1] / acc[2]:.4f}  "
                  f"val E-MAE {e_mae:.4f} F-MAE {f_mae:.4f} kcal/mol(/A)  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  {time.time() - t0:.1f}s", flush=True)
        if rank == 0 and f_mae < best_val:
            best_val = f_mae
            torch.save({"model": model.state_dict(), "e_mean": e_mean.cpu(), "epoch": epoch,
                        "val_f_mae": f_mae}, os.path.join(args.out, "best.pt"))
        if optimizer.param_groups[0]["lr"] <= 1e-6:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
