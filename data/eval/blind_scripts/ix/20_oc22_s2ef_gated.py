"""OC22 S2EF (total energy) with a gated edge-conv model; step-based checkpointing
because the cluster pre-empts jobs after 4 hours.

    torchrun --nnodes=1 --nproc_per_node=8 20_oc22_s2ef_gated.py \
        --train_src /data/oc22/s2ef_total/train --val_src /data/oc22/s2ef_total/val_id \
        --run_dir /shared/runs/oc22_gated
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fairchem.core.common.utils import get_pbc_distances, radius_graph_pbc
from fairchem.core.datasets import LmdbDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


class GatedEdgeBlock(nn.Module):
    def __init__(self, dim, n_rbf):
        super().__init__()
        self.edge = nn.Linear(2 * dim + n_rbf, 2 * dim)
        self.norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, h, edge_index, rbf, env):
        src, dst = edge_index
        g, c = self.edge(torch.cat([h[src], h[dst], rbf], -1)).chunk(2, -1)
        m = torch.sigmoid(g) * F.silu(c) * env.unsqueeze(-1)
        h = h + scatter(m, dst, dim=0, dim_size=h.size(0))
        return h + self.ffn(self.norm(h))


class GatedNet(nn.Module):
    def __init__(self, dim=256, n_blocks=6, n_rbf=64, cutoff=6.0, max_neighbors=40):
        super().__init__()
        self.cutoff, self.max_neighbors = cutoff, max_neighbors
        self.emb = nn.Embedding(100, dim)
        self.register_buffer("centers", torch.linspace(0.0, cutoff, n_rbf))
        self.blocks = nn.ModuleList(GatedEdgeBlock(dim, n_rbf) for _ in range(n_blocks))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, data):
        edge_index, cell_offsets, nbrs = radius_graph_pbc(data, self.cutoff, self.max_neighbors)
        out = get_pbc_distances(data.pos, edge_index, data.cell, cell_offsets, nbrs)
        edge_index, d = out["edge_index"], out["distances"]
        rbf = torch.exp(-((d.unsqueeze(-1) - self.centers) ** 2) / (2 * (self.cutoff / len(self.centers)) ** 2))
        env = 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1.0)
        h = self.emb(data.atomic_numbers.long())
        for blk in self.blocks:
            h = blk(h, edge_index, rbf, env)
        return scatter(self.head(h).squeeze(-1), data.batch, dim=0, dim_size=data.num_graphs)


def energy_and_forces(model, batch, train):
    batch.pos.requires_grad_(True)
    energy = model(batch)
    forces = -torch.autograd.grad(energy.sum(), batch.pos, create_graph=train)[0]
    return energy, forces


def save_checkpoint(path, model, optimizer, scheduler, epoch, step, best):
    state = {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "step": step,
        "best_val": best,
    }
    torch.save(state, path)


def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device)
        e, f = energy_and_forces(model, batch, train=False)
        acc[0] += (e.detach() - batch.y).abs().sum()
        acc[1] += batch.num_graphs
        acc[2] += (f.detach() - batch.force).abs().sum()
        acc[3] += f.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_src", required=True)
    ap.add_argument("--val_src", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--energy_coef", type=float, default=1.0)
    ap.add_argument("--force_coef", type=float, default=1.0)
    ap.add_argument("--save_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.run_dir, exist_ok=True)

    train_ds = LmdbDataset({"src": args.train_src})
    val_ds = LmdbDataset({"src": args.val_src})
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=16, sampler=val_sampler, num_workers=4)

    model = DDP(GatedNet().to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.001)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / 2000) * max(0.01, 0.5 * (1 + math.cos(math.pi * s / total_steps))))

    ckpt_path = os.path.join(args.run_dir, "checkpoint.pt")
    start_epoch, step, best = 0, 0, float("inf")
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step, best = ckpt["epoch"], ckpt["step"], ckpt["best_val"]

    steps_per_epoch = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        done_in_epoch = step - epoch * steps_per_epoch
        for i, batch in enumerate(train_loader):
            if i < done_in_epoch:
                continue
            batch = batch.to(device, non_blocking=True)
            e, f = energy_and_forces(model, batch, train=True)
            natoms = batch.natoms.to(e.dtype)
            loss = args.energy_coef * F.l1_loss(e / natoms, batch.y / natoms) + \
                args.force_coef * (f - batch.force).norm(dim=-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 50.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} epoch {epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
            if step % args.save_every == 0:
                save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch, step, best)

        e_mae, f_mae = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): val energy MAE {e_mae:.4f} eV, force MAE {f_mae:.4f} eV/A",
                  flush=True)
        if f_mae < best:
            best = f_mae
            save_checkpoint(os.path.join(args.run_dir, "best.pt"), model, optimizer, scheduler, epoch + 1, step, best)
        save_checkpoint(ckpt_path, model, optimizer, scheduler, epoch + 1, step, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
