#!/usr/bin/env python
"""SchNet on QM9 (U0), data-parallel over the GPUs of one node.

    torchrun --nproc_per_node=4 01_schnet_qm9_u0.py --data-root data/QM9 --out runs/schnet_u0
"""
import argparse
import json
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

TARGET_U0 = 7  # PyG QM9 column, already in eV


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="data/QM9")
    p.add_argument("--out", default="runs/schnet_u0")
    p.add_argument("--target", type=int, default=TARGET_U0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--filters", type=int, default=128)
    p.add_argument("--interactions", type=int, default=6)
    p.add_argument("--gaussians", type=int, default=50)
    p.add_argument("--cutoff", type=float, default=10.0)
    p.add_argument("--batch-size", type=int, default=32, help="molecules per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-6)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--n-train", type=int, default=110000)
    p.add_argument("--n-val", type=int, default=10000)
    p.add_argument("--resume", default="")
    return p.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def load_qm9(root, rank):
    # PyG processes the raw sdf/csv on first use; let rank 0 do it alone.
    if rank == 0:
        QM9(root)
    dist.barrier()
    return QM9(root)


def random_split(dataset, n_train, n_val, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(dataset), generator=g)
    train = dataset[perm[:n_train]]
    val = dataset[perm[n_train:n_train + n_val]]
    test = dataset[perm[n_train + n_val:]]
    return train, val, test


@torch.no_grad()
def evaluate(model, loader, target, device):
    model.eval()
    abs_err = 0.0
    n_mol = 0
    for data in loader:
        data = data.to(device)
        pred = model(data.z, data.pos, data.batch).view(-1)
        abs_err += (pred - data.y[:, target]).abs().sum().item()
        n_mol += data.num_graphs
    return abs_err / max(n_mol, 1)


def save_checkpoint(path, model, optimizer, scheduler, epoch, best_val):
    tmp = path + ".tmp"
    torch.save(
        {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "best_val": best_val,
        },
        tmp,
    )
    os.replace(tmp, path)


def main():
    args = parse_args()
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    dataset = load_qm9(args.data_root, rank)
    train_set, val_set, test_set = random_split(dataset, args.n_train, args.n_val, args.seed)
    atomref = dataset.atomref(args.target)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler, num_workers=args.workers)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler, num_workers=args.workers)

    model = SchNet(
        hidden_channels=args.hidden,
        num_filters=args.filters,
        num_interactions=args.interactions,
        num_gaussians=args.gaussians,
        cutoff=args.cutoff,
        atomref=atomref,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=0.8, patience=10, min_lr=args.min_lr)

    start_epoch, best_val = 1, float("inf")
    ckpt_path = os.path.join(args.out, "last.pt")
    best_path = os.path.join(args.out, "best.pt")
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]

    for epoch in range(start_epoch, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            pred = model(data.z, data.pos, data.batch).view(-1)
            loss = F.l1_loss(pred, data.y[:, args.target])
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach() * data.num_graphs
            loss_sum[1] += data.num_graphs
        dist.all_reduce(loss_sum)
        train_mae = (loss_sum[0] / loss_sum[1]).item()

        val_mae = evaluate(model.module, val_loader, args.target, device)
        scheduler.step(val_mae)

        if rank == 0:
            lr = optimizer.param_groups[0]["lr"]
            print(f"epoch {epoch:4d} | train MAE {train_mae:.4f} eV | val MAE {val_mae:.4f} eV "
                  f"| lr {lr:.2e} | {time.time() - t0:.1f}s", flush=True)
            if val_mae < best_val:
                best_val = val_mae
                save_checkpoint(best_path, model, optimizer, scheduler, epoch, best_val)
            save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch, best_val)
        dist.barrier()

        if optimizer.param_groups[0]["lr"] <= args.min_lr:
            break

    ckpt = torch.load(best_path, map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_mae = evaluate(model.module, test_loader, args.target, device)
    if rank == 0:
        print(f"best epoch {ckpt['epoch']} | test MAE {test_mae * 1000:.2f} meV", flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"val_mae": best_val, "test_mae": test_mae}, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
