"""SchNet energy/force training on an extxyz trajectory dataset.

Preprocessed graphs (radius graph, padded-free) are cached next to the raw file
so later runs start immediately.

    torchrun --nproc_per_node=4 05_schnet_aspirin.py --data data/aspirin_ccsd.extxyz --cutoff 5.0
"""
import argparse
import logging
import os
import time

import ase.io
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import SchNet, radius_graph
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("schnet")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--filters", type=int, default=128)
    p.add_argument("--interactions", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--force-weight", type=float, default=100.0)
    p.add_argument("--val-frac", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/schnet")
    return p.parse_args()


def preprocess(path, cutoff):
    """Read every frame, build radius graphs once and return a list of Data."""
    frames = ase.io.read(path, index=":")
    graphs = []
    for atoms in frames:
        pos = torch.tensor(atoms.get_positions(), dtype=torch.float32)
        z = torch.tensor(atoms.get_atomic_numbers(), dtype=torch.long)
        energy = torch.tensor([atoms.get_potential_energy()], dtype=torch.float32)
        forces = torch.tensor(atoms.get_forces(), dtype=torch.float32)
        edge_index = radius_graph(pos, r=cutoff, max_num_neighbors=64)
        graphs.append(Data(z=z, pos=pos, energy=energy, forces=forces,
                           edge_index=edge_index, num_nodes=z.numel()))
    return graphs


def load_or_build(path, cutoff):
    cache = f"{os.path.splitext(path)[0]}_r{cutoff:.1f}.pt"
    if os.path.exists(cache):
        log.info("loading cached graphs from %s", cache)
        return torch.load(cache)
    log.info("building graphs from %s (this takes a while)", path)
    graphs = preprocess(path, cutoff)
    torch.save(graphs, cache)
    return graphs


def energy_and_forces(model, batch):
    pos = batch.pos.requires_grad_(True)
    energy = model(batch.z, pos, batch.batch).view(-1)
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=model.training)[0]
    return energy, forces


def run_epoch(model, loader, opt, args, device, train):
    model.train(train)
    stats = torch.zeros(4, device=device)  # e_abs, f_abs, n_mol, n_atoms
    for batch in loader:
        batch = batch.to(device)
        with torch.set_grad_enabled(True):
            e_pred, f_pred = energy_and_forces(model, batch)
            e_loss = F.mse_loss(e_pred, batch.energy)
            f_loss = F.mse_loss(f_pred, batch.forces)
            loss = e_loss + args.force_weight * f_loss
        if train:
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
        stats[0] += (e_pred.detach() - batch.energy).abs().sum()
        stats[1] += (f_pred.detach() - batch.forces).abs().sum()
        stats[2] += batch.num_graphs
        stats[3] += batch.num_nodes * 3
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[3]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    graphs = load_or_build(args.data, args.cutoff)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(graphs), generator=g).tolist()
    n_val = int(args.val_frac * len(graphs))
    val_set = [graphs[i] for i in perm[:n_val]]
    train_set = [graphs[i] for i in perm[n_val:]]

    # per-atom energy shift from the training set (same on every rank: same split)
    e_mean = torch.stack([d.energy / d.num_nodes for d in train_set]).mean().item()

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=2)

    model = SchNet(hidden_channels=args.hidden, num_filters=args.filters,
                   num_interactions=args.interactions, cutoff=args.cutoff,
                   mean=e_mean, readout="add").to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=10, min_lr=1e-6)

    os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_e, tr_f = run_epoch(model, train_loader, opt, args, device, train=True)
        # forces need autograd in validation too; go through the bare module there
        va_e, va_f = run_epoch(model.module, val_loader, opt, args, device, train=False)
        val_score = va_e + args.force_weight * va_f
        sched.step(val_score)
        log.info("epoch %d | train E-MAE %.4f F-MAE %.4f | val E-MAE %.4f F-MAE %.4f | lr %.2e | %.0fs",
                 epoch, tr_e, tr_f, va_e, va_f, opt.param_groups[0]["lr"], time.time() - t0)
        if rank == 0 and val_score < best:
            best = val_score
            torch.save({"model": model.module.state_dict(), "epoch": epoch,
                        "e_mean": e_mean, "args": vars(args)},
                       os.path.join(args.out, "best.pt"))
        if opt.param_groups[0]["lr"] <= 1e-6:
            log.info("learning rate floor reached, stopping")
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
