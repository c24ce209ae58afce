"""DimeNet++ energy+force training on MD17 (PyG implementation), DDP.

Forces = -dE/dx by autograd through the DimeNet++ graph.

    torchrun --standalone --nproc_per_node=2 12_dimenetpp_md17_forces.py --molecule "ethanol" --out runs/dpp_ethanol
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import MD17
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import DimeNetPlusPlus

log = logging.getLogger("dpp_md17")


class EnergyForceModel(nn.Module):
    def __init__(self, mean, std, **kw):
        super().__init__()
        self.net = DimeNetPlusPlus(out_channels=1, **kw)
        self.register_buffer("mean", torch.tensor(mean))
        self.register_buffer("std", torch.tensor(std))

    def forward(self, z, pos, batch, create_graph):
        pos = pos.requires_grad_(True)
        energy = self.net(z, pos, batch).view(-1) * self.std + self.mean
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=create_graph)[0]
        return energy, forces


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/MD17")
    p.add_argument("--molecule", default="ethanol")
    p.add_argument("--out", default="runs/dpp_md17")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-val", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=1500)
    p.add_argument("--rho", type=float, default=0.01)
    p.add_argument("--patience", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def evaluate(model, loader, device):
    model.eval()
    e_sum = f_sum = 0.0
    n_mol = n_comp = 0
    for data in loader:
        data = data.to(device)
        e, f = model(data.z, data.pos, data.batch, create_graph=False)
        e_sum += (e.detach() - data.energy.view(-1)).abs().sum().item()
        f_sum += (f.detach() - data.force).abs().sum().item()
        n_mol += data.num_graphs
        n_comp += data.force.numel()
    totals = torch.tensor([e_sum, f_sum, n_mol, n_comp], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[3]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    if rank == 0:
        MD17(args.root, name=args.molecule)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    dataset = MD17(args.root, name=args.molecule)

    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(dataset), generator=g)
    n_tr, n_va = args.n_train, args.n_val
    train_set = dataset[perm[:n_tr]]
    val_set = dataset[perm[n_tr:n_tr + n_va]]
    test_set = dataset[perm[n_tr + n_va:]]

    energies = torch.cat([d.energy.view(-1) for d in train_set])
    mean, std = energies.mean().item(), energies.std().item()
    log.info("train energies: mean %.3f std %.3f kcal/mol", mean, std)

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    val_loader = DataLoader(val_set[torch.arange(rank, n_va, world)], batch_size=100)
    test_loader = DataLoader(test_set[torch.arange(rank, len(test_set), world)], batch_size=100)

    model = EnergyForceModel(mean, std, hidden_channels=128, num_blocks=4, int_emb_size=64, basis_emb_size=8,
                             out_emb_channels=256, num_spherical=7, num_radial=6, cutoff=5.0).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, amsgrad=True)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=args.patience, min_lr=1e-6)

    best, best_path = float("inf"), os.path.join(args.out, "best.pt")
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            e, f = model(data.z, data.pos, data.batch, create_graph=True)
            loss_e = ((e - data.energy.view(-1)) ** 2).mean()
            loss_f = ((f - data.force) ** 2).mean()
            loss = args.rho * loss_e + (1 - args.rho) * loss_f
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        e_mae, f_mae = evaluate(model.module, val_loader, device)
        plateau.step(args.rho * e_mae + (1 - args.rho) * f_mae)
        log.info("epoch %4d  val E %.4f  F %.4f  lr %.1e  (%.1fs)", epoch, e_mae, f_mae,
                 opt.param_groups[0]["lr"], time.time() - t0)
        if rank == 0 and f_mae < best:
            best = f_mae
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, best_path)
        dist.barrier()
        if opt.param_groups[0]["lr"] < 1.1e-6:
            break

    model.module.load_state_dict(torch.load(best_path, map_location=device)["model"])
    e_mae, f_mae = evaluate(model.module, test_loader, device)
    log.info("TEST energy MAE %.4f kcal/mol  force MAE %.4f kcal/mol/A", e_mae, f_mae)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
