#!/usr/bin/env python
"""OC20 S2EF: SchNet with on-the-fly periodic radius graphs, gradient forces,
gradient accumulation and EMA weights.

    torchrun --nnodes=1 --nproc_per_node=8 04_oc20_s2ef_schnet_accum.py \
        --train /data/oc20/s2ef/2M/train --val /data/oc20/s2ef/all/val_id \
        --global_batch 256 --accum 2 --out /checkpoint/oc20/schnet_2M
"""
import argparse
import contextlib
import copy
import itertools
import math
import os
import pickle
from pathlib import Path

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


class OC20Lmdb(Dataset):
    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*.lmdb"))
        self.envs = None
        self.keys = []
        for fi, fn in enumerate(self.files):
            env = lmdb.open(str(fn), subdir=False, readonly=True, lock=False)
            with env.begin() as txn:
                n = pickle.loads(txn.get(b"length"))
            env.close()
            self.keys.extend((fi, k) for k in range(n))

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, idx):
        if self.envs is None:  # opened in the worker process
            self.envs = [lmdb.open(str(fn), subdir=False, readonly=True, lock=False, readahead=False,
                                   meminit=False, max_readers=1) for fn in self.files]
        fi, k = self.keys[idx]
        with self.envs[fi].begin() as txn:
            return pickle.loads(txn.get(str(k).encode()))


IMAGES = torch.tensor(list(itertools.product((-1, 0, 1), repeat=3)), dtype=torch.float32)


@torch.no_grad()
def radius_graph_pbc(pos, cell, natoms, cutoff):
    """All pairs (i, j, image) within `cutoff`, restricted to the 27 nearest cell images.

    Returns edge_index [2, E] (source, target) and the integer image offset per edge.
    """
    device = pos.device
    n_graphs = natoms.numel()
    ptr = torch.cat([natoms.new_zeros(1), natoms.cumsum(0)])
    n_sq = natoms * natoms
    pair_graph = torch.repeat_interleave(torch.arange(n_graphs, device=device), n_sq)
    local = torch.arange(int(n_sq.sum()), device=device) - torch.repeat_interleave(n_sq.cumsum(0) - n_sq, n_sq)
    n_rep = natoms[pair_graph]
    i = local // n_rep + ptr[pair_graph]
    j = local % n_rep + ptr[pair_graph]

    images = IMAGES.to(device=device, dtype=pos.dtype)
    shifts = torch.einsum("ok,bkl->bol", images, cell)  # [B, 27, 3]
    vec = pos[j].unsqueeze(1) + shifts[pair_graph] - pos[i].unsqueeze(1)
    dist_ = vec.norm(dim=-1)
    mask = (dist_ < cutoff) & (dist_ > 1e-4)
    pair, img = mask.nonzero(as_tuple=True)
    return torch.stack([j[pair], i[pair]]), images[img]


class GaussianRBF(nn.Module):
    def __init__(self, cutoff, n):
        super().__init__()
        self.register_buffer("mu", torch.linspace(0, cutoff, n))
        self.coeff = -0.5 / (cutoff / (n - 1)) ** 2

    def forward(self, d):
        return torch.exp(self.coeff * (d.unsqueeze(-1) - self.mu) ** 2)


class CFConvBlock(nn.Module):
    def __init__(self, hidden, n_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.mlp = nn.Sequential(nn.Linear(n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.pre = nn.Linear(hidden, hidden, bias=False)
        self.post = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h, edge_index, d, rbf):
        w = self.mlp(rbf) * (0.5 * (torch.cos(math.pi * d / self.cutoff) + 1)).unsqueeze(-1)
        agg = scatter(self.pre(h)[edge_index[0]] * w, edge_index[1], dim=0, dim_size=h.size(0))
        return h + self.post(agg)


class SchNetPBC(nn.Module):
    def __init__(self, hidden=384, blocks=5, n_rbf=100, cutoff=6.0):
        super().__init__()
        self.cutoff = cutoff
        self.emb = nn.Embedding(100, hidden)
        self.rbf = GaussianRBF(cutoff, n_rbf)
        self.blocks = nn.ModuleList(CFConvBlock(hidden, n_rbf, cutoff) for _ in range(blocks))
        self.out = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))

    def forward(self, z, pos, cell, natoms, batch):
        edge_index, img = radius_graph_pbc(pos.detach(), cell, natoms, self.cutoff)
        src, dst = edge_index
        shift = torch.einsum("ek,ekl->el", img, cell[batch[src]])
        d = (pos[src] + shift - pos[dst]).norm(dim=-1)
        rbf = self.rbf(d)
        h = self.emb(z)
        for blk in self.blocks:
            h = blk(h, edge_index, d, rbf)
        return scatter(self.out(h).squeeze(-1), batch, dim=0, dim_size=natoms.numel())


def run_model(model, batch, create_graph):
    pos = batch.pos.requires_grad_(True)
    energy = model(batch.atomic_numbers.long(), pos, batch.cell, batch.natoms, batch.batch)
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=create_graph)[0]
    return energy, forces


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(4, device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device)
        energy, forces = run_model(net, batch, create_graph=False)
        acc[0] += (energy.detach() - batch.y).abs().sum()
        acc[1] += batch.num_graphs
        acc[2] += (forces.detach() - batch.force).abs().sum()
        acc[3] += forces.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--global_batch", type=int, default=256, help="systems per optimizer step, all GPUs")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--force_weight", type=float, default=50.0)
    ap.add_argument("--ema_decay", type=float, default=0.999)
    ap.add_argument("--num_workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    assert args.global_batch % (world * args.accum) == 0, "global batch must split evenly over GPUs x accum"
    micro_batch = args.global_batch // (world * args.accum)

    train_set, val_set = OC20Lmdb(args.train), OC20Lmdb(args.val)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=micro_batch, sampler=sampler, num_workers=args.num_workers,
                              pin_memory=True, persistent_workers=True, drop_last=True)
    # strided shard of the validation set: no padding, no duplicates
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=32, num_workers=4)

    net = SchNetPBC().to(device)
    ema = copy.deepcopy(net).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    steps_per_epoch = len(train_loader) // args.accum
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.05,
                                                    total_steps=args.epochs * steps_per_epoch + 1)

    out = Path(args.out)
    ckpt_path = out / "last.pt"
    start_epoch = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
    elif rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        n_batches = len(train_loader)
        for i, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0 or i + 1 == n_batches
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                energy, forces = run_model(model, batch, create_graph=True)
                natoms = batch.natoms.to(energy.dtype)
                loss = F.l1_loss(energy / natoms, batch.y / natoms) + args.force_weight * F.l1_loss(forces, batch.force)
                (loss / args.accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 20.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if scheduler.last_epoch < scheduler.total_steps - 1:
                    scheduler.step()
                ema_update(ema, net, args.ema_decay)
            if rank == 0 and i % 500 == 0:
                print(f"epoch {epoch} it {i}/{n_batches} loss {loss.item():.4f}", flush=True)

        e_mae, f_mae = evaluate(ema, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val(EMA) energy MAE {e_mae:.4f} eV, force MAE {f_mae:.4f} eV/A", flush=True)
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, out / "tmp.pt")
            os.replace(out / "tmp.pt", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
