"""OC20 IS2RE direct: predict the relaxed adsorption energy from the initial structure.

Graphs are generated on the fly on the GPU (periodic boundary conditions, cutoff and
neighbour cap are properties of the model so that inference uses the same settings).

    torchrun --nproc_per_node=8 12_oc20_is2re_direct.py --data /data/oc20/is2re/all --out runs/is2re_cgcnn
"""
import argparse
import itertools
import math
import os
import pickle
import time

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


class IS2RELmdb(Dataset):
    """OC20 IS2RE split: a single data.lmdb per split with pickled Data objects."""

    def __init__(self, path):
        self.path = path
        env = self._connect()
        self.length = env.stat()["entries"]
        env.close()
        self.env = None

    def _connect(self):
        return lmdb.open(self.path, subdir=False, readonly=True, lock=False, readahead=False, meminit=False)

    def __len__(self):
        return self.length

    def __getitem__(self, idx):
        if self.env is None:
            self.env = self._connect()
        with self.env.begin() as txn:
            return pickle.loads(txn.get(f"{idx}".encode("ascii")))


_IMG = list(itertools.product((-1, 0, 1), repeat=3))


@torch.no_grad()
def build_pbc_graph(pos, cell, natoms, cutoff, max_neighbors):
    """Neighbour search over the 27 surrounding images, keeping the `max_neighbors` closest per atom."""
    device = pos.device
    img = torch.tensor(_IMG, device=device, dtype=pos.dtype)
    edges, offsets = [], []
    start = 0
    for g, n in enumerate(natoms.tolist()):
        p = pos[start:start + n]
        shifts = img @ cell[g]
        rel = p[None, :, None, :] + shifts[:, None, None, :] - p[None, None, :, :]  # [27, j, i, 3]
        d = rel.norm(dim=-1)
        d = torch.where((d < cutoff) & (d > 1e-6), d, torch.full_like(d, float("inf")))
        d = d.permute(2, 0, 1).reshape(n, -1)                                       # [i, 27*j]
        k = min(max_neighbors, d.size(1))
        dk, ik = torch.topk(d, k, dim=1, largest=False)
        keep = torch.isfinite(dk)
        i = torch.arange(n, device=device).unsqueeze(1).expand(-1, k)[keep]
        flat = ik[keep]
        j, im = flat % n, flat // n
        edges.append(torch.stack([j + start, i + start]))
        offsets.append(img[im])
        start += n
    return torch.cat(edges, dim=1), torch.cat(offsets)


class GatedConv(nn.Module):
    def __init__(self, dim, edge_dim):
        super().__init__()
        self.lin = nn.Linear(2 * dim + edge_dim, 2 * dim)
        self.bn = nn.LayerNorm(2 * dim)

    def forward(self, h, edge_index, e):
        s, t = edge_index
        gate, core = self.bn(self.lin(torch.cat([h[t], h[s], e], -1))).chunk(2, -1)
        return F.softplus(h + scatter(torch.sigmoid(gate) * F.softplus(core), t, dim=0, dim_size=h.size(0)))


class IS2REModel(nn.Module):
    def __init__(self, dim=256, layers=6, n_gauss=100, cutoff=6.0, max_neighbors=50):
        super().__init__()
        self.cutoff = cutoff
        self.max_neighbors = max_neighbors
        self.emb = nn.Embedding(100, dim)
        self.tag_emb = nn.Embedding(3, dim)  # 0 subsurface, 1 surface, 2 adsorbate
        self.register_buffer("mu", torch.linspace(0.0, cutoff, n_gauss))
        self.convs = nn.ModuleList(GatedConv(dim, n_gauss) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, data, edge_index, offsets):
        s, t = edge_index
        shift = torch.einsum("ek,ekl->el", offsets, data.cell[data.batch[s]])
        d = (data.pos[s] + shift - data.pos[t]).norm(dim=-1)
        e = torch.exp(-((d.unsqueeze(-1) - self.mu) / (self.cutoff / len(self.mu))) ** 2)
        h = self.emb(data.atomic_numbers.long()) + self.tag_emb(data.tags.long())
        for conv in self.convs:
            h = conv(h, edge_index, e)
        return scatter(self.head(h).squeeze(-1), data.batch, dim=0, dim_size=data.num_graphs, reduce="sum")


def forward_batch(model, batch):
    edge_index, offsets = build_pbc_graph(batch.pos, batch.cell, batch.natoms, model.cutoff, model.max_neighbors)
    return model(batch, edge_index, offsets)


@torch.no_grad()
def evaluate(model, loader, device, mean, std):
    model.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device)
        pred = forward_batch(model, batch) * std + mean
        err = (pred - batch.y_relaxed).abs()
        s += torch.stack([err.sum(), (err < 0.02).sum().to(err.dtype), torch.tensor(batch.num_graphs, device=device, dtype=err.dtype)]).double()
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/is2re")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--target_mean", type=float, default=-1.525913953781128)  # OC20 IS2RE all, from the OCP configs
    ap.add_argument("--target_std", type=float, default=2.279365062713623)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = IS2RELmdb(os.path.join(args.data, "train", "data.lmdb"))
    val_ds = IS2RELmdb(os.path.join(args.data, "val_id", "data.lmdb"))
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=4)

    model = DDP(IS2REModel().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    milestones = [int(f * args.epochs * len(train_loader)) for f in (0.5, 0.75, 0.9)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            target = (batch.y_relaxed - args.target_mean) / args.target_std
            loss = F.l1_loss(forward_batch(model, batch), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        mae, ewt = evaluate(model, val_loader, device, args.target_mean, args.target_std)
        if rank == 0:
            print(f"epoch {epoch}: val_id energy MAE {mae:.4f} eV, EwT {100 * ewt:.2f}% ({time.time() - t0:.0f}s)",
                  flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                    "normalizer": {"mean": args.target_mean, "std": args.target_std}}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if mae < best:
                best = mae
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
