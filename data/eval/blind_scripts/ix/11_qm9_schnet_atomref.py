"""QM9 enthalpy / energy targets with PyG SchNet + single-atom reference energies.

Trains with DDP, keeps the best checkpoint by validation MAE, then reloads it in a
fresh model for the test set and writes per-molecule predictions.

    torchrun --standalone --nproc_per_node=4 11_qm9_schnet_atomref.py --target 7 --root /data/pyg/QM9
"""
import argparse
import csv
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

TARGET_NAMES = {7: "U0", 8: "U", 9: "H", 10: "G"}  # the targets with atom references in QM9


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/pyg/QM9")
    ap.add_argument("--target", type=int, default=7, choices=sorted(TARGET_NAMES))
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--decay_steps", type=int, default=100000)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--interactions", type=int, default=6)
    ap.add_argument("--cutoff", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt_dir", default="checkpoints/schnet_qm9")
    return ap.parse_args()


def build_model(args, atomref):
    return SchNet(hidden_channels=args.hidden, num_filters=args.hidden, num_interactions=args.interactions,
                  num_gaussians=50, cutoff=args.cutoff, readout="add", atomref=atomref)


@torch.no_grad()
def evaluate(model, loader, target, device, reduce=True):
    model.eval()
    err = torch.zeros(2, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device)
        pred = model(data.z, data.pos, data.batch).view(-1)
        err[0] += (pred - data.y[:, target]).abs().sum()
        err[1] += data.num_graphs
    if reduce:
        dist.all_reduce(err)
    return (err[0] / err[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        QM9(args.root)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()
    dataset = QM9(args.root)
    atomref = dataset.atomref(args.target)

    idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    train_idx, val_idx, test_idx = idx[:110000], idx[110000:120000], idx[120000:]
    train_set = Subset(dataset, train_idx.tolist())
    val_shard = Subset(dataset, val_idx[rank::world].tolist())

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=6, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=256, num_workers=2)

    torch.manual_seed(args.seed)
    model = DDP(build_model(args, atomref).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # exponential decay per optimizer step, as in the original SchNet setup
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.96 ** (s / args.decay_steps))

    best_val = float("inf")
    best_path = os.path.join(args.ckpt_dir, f"best_{TARGET_NAMES[args.target]}.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred = model(data.z, data.pos, data.batch).view(-1)
            loss = F.mse_loss(pred, data.y[:, args.target])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum[0] += loss.detach() * data.num_graphs
            loss_sum[1] += data.num_graphs
        dist.all_reduce(loss_sum)

        val_mae = evaluate(model, val_loader, args.target, device)
        if rank == 0:
            print(f"epoch {epoch:3d} | train RMSE {(loss_sum[0] / loss_sum[1]).sqrt().item():.4f} eV | "
                  f"val MAE {val_mae * 1000:.2f} meV | {time.time() - t0:.0f}s", flush=True)
            if val_mae < best_val:
                best_val = val_mae
                torch.save({"state_dict": model.state_dict(), "epoch": epoch, "val_mae": val_mae,
                            "args": vars(args)}, best_path)
        dist.barrier()

    if rank == 0:
        ckpt = torch.load(best_path, map_location=device)
        test_model = build_model(args, atomref).to(device)
        test_model.load_state_dict(ckpt["state_dict"])
        test_loader = DataLoader(Subset(dataset, test_idx.tolist()), batch_size=256)
        test_mae = evaluate(test_model, test_loader, args.target, device, reduce=False)
        print(f"best epoch {ckpt['epoch']}: test MAE {test_mae * 1000:.2f} meV")

        test_model.eval()
        with open(os.path.join(args.ckpt_dir, f"test_predictions_{TARGET_NAMES[args.target]}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["idx", "target", "prediction"])
            with torch.no_grad():
                for data in test_loader:
                    data = data.to(device)
                    pred = test_model(data.z, data.pos, data.batch).view(-1)
                    for i, t, p in zip(data.idx.tolist(), data.y[:, args.target].tolist(), pred.tolist()):
                        w.writerow([i, f"{t:.6f}", f"{p:.6f}"])

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
