"""
Message passing neural net (hand-written, no PyG) for QM9 HOMO-LUMO gap regression.

qm9_processed.pkl is a list of dicts: {"z": int array (n,), "pos": float array (n, 3), "y": float array (19,)}
Target index 4 = gap in Hartree (we train in eV).

usage:  python 03_mpnn_qm9_spawn.py --gpus 4 --epochs 300
"""
import argparse
import os
import pickle
import random
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HARTREE_TO_EV = 27.211386
TARGET_IDX = 4


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/qm9_processed.pkl")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", default="29533")
    p.add_argument("--save", default="ckpt/mpnn_gap.pt")
    return p.parse_args()


class QM9(Dataset):
    def __init__(self, mols):
        self.mols = mols

    def __len__(self):
        return len(self.mols)

    def __getitem__(self, i):
        m = self.mols[i]
        return (torch.as_tensor(m["z"], dtype=torch.long),
                torch.as_tensor(m["pos"], dtype=torch.float32),
                torch.tensor(m["y"][TARGET_IDX] * HARTREE_TO_EV, dtype=torch.float32))


def collate_graphs(batch, cutoff=5.0):
    zs, poss, ys, batch_idx, edges = [], [], [], [], []
    offset = 0
    for gi, (z, pos, y) in enumerate(batch):
        n = z.shape[0]
        d = torch.cdist(pos, pos)
        src, dst = torch.nonzero((d < cutoff) & (d > 0), as_tuple=True)
        edges.append(torch.stack([src + offset, dst + offset]))
        zs.append(z)
        poss.append(pos)
        ys.append(y)
        batch_idx.append(torch.full((n,), gi, dtype=torch.long))
        offset += n
    return (torch.cat(zs), torch.cat(poss), torch.cat(edges, dim=1),
            torch.cat(batch_idx), torch.stack(ys))


class GaussianSmearing(nn.Module):
    def __init__(self, start=0.0, stop=5.0, n=50):
        super().__init__()
        offs = torch.linspace(start, stop, n)
        self.register_buffer("offset", offs)
        self.coeff = -0.5 / (offs[1] - offs[0]).item() ** 2

    def forward(self, d):
        return torch.exp(self.coeff * (d.unsqueeze(-1) - self.offset) ** 2)


class MPLayer(nn.Module):
    def __init__(self, h, n_rbf):
        super().__init__()
        self.msg = nn.Sequential(nn.Linear(2 * h + n_rbf, h), nn.SiLU(), nn.Linear(h, h))
        self.upd = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))
        self.norm = nn.LayerNorm(h)

    def forward(self, x, edge_index, rbf):
        src, dst = edge_index
        m = self.msg(torch.cat([x[src], x[dst], rbf], dim=-1))
        agg = torch.zeros_like(x).index_add_(0, dst, m)
        return self.norm(x + self.upd(torch.cat([x, agg], dim=-1)))


class MPNN(nn.Module):
    def __init__(self, hidden=128, layers=4, cutoff=5.0, n_rbf=50):
        super().__init__()
        self.emb = nn.Embedding(10, hidden)
        self.rbf = GaussianSmearing(0.0, cutoff, n_rbf)
        self.layers = nn.ModuleList([MPLayer(hidden, n_rbf) for _ in range(layers)])
        self.readout = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, z, pos, edge_index, batch, n_graphs):
        x = self.emb(z)
        d = (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)
        rbf = self.rbf(d)
        for layer in self.layers:
            x = layer(x, edge_index, rbf)
        out = torch.zeros(n_graphs, x.shape[-1], device=x.device).index_add_(0, batch, x)
        return self.readout(out).squeeze(-1)


# atomic numbers in QM9 are H C N O F -> map to small indices
Z_MAP = torch.zeros(10, dtype=torch.long)
for k, v in {1: 1, 6: 2, 7: 3, 8: 4, 9: 5}.items():
    Z_MAP[k] = v


def split_indices(n, seed=0):
    rng = np.random.RandomState(seed)
    perm = rng.permutation(n)
    return perm[:110000], perm[110000:120000], perm[120000:]


def run_epoch(model, loader, device, opt=None):
    train = opt is not None
    model.train(train)
    tot = torch.zeros(2, device=device)
    with torch.set_grad_enabled(train):
        for z, pos, ei, b, y in loader:
            z, pos, ei, b, y = (t.to(device, non_blocking=True) for t in (z, pos, ei, b, y))
            pred = model(Z_MAP.to(device)[z], pos, ei, b, y.shape[0])
            loss = (pred - y).abs().mean()
            if train:
                opt.zero_grad()
                loss.backward()
                opt.step()
            tot[0] += loss.detach() * y.shape[0]
            tot[1] += y.shape[0]
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item()


def train_worker(gpu, args):
    world_size = args.gpus
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", rank=gpu, world_size=world_size)
    device = torch.device("cuda", gpu)
    torch.manual_seed(args.seed)

    with open(args.data, "rb") as f:
        mols = pickle.load(f)
    tr_idx, va_idx, te_idx = split_indices(len(mols), args.seed)
    train_ds = QM9([mols[i] for i in tr_idx])
    val_ds = QM9([mols[i] for i in va_idx])

    collate = partial(collate_graphs, cutoff=args.cutoff)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train_ds, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate,
                           num_workers=4, pin_memory=True)
    va_loader = DataLoader(val_ds, batch_size=256, sampler=va_sampler, collate_fn=collate, num_workers=2)

    model = DDP(MPNN(args.hidden, args.layers, args.cutoff).to(device), device_ids=[gpu])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.7, patience=10, min_lr=1e-6)

    best = float("inf")
    for epoch in range(1, args.epochs + 1):
        tr_sampler.set_epoch(epoch)
        t0 = time.time()
        tr_mae = run_epoch(model, tr_loader, device, opt)
        va_mae = run_epoch(model, va_loader, device)
        sched.step(va_mae)
        if gpu == 0:
            print(f"epoch {epoch:4d} | train MAE {tr_mae:.4f} eV | val MAE {va_mae:.4f} eV | "
                  f"lr {opt.param_groups[0]['lr']:.1e} | {time.time() - t0:.1f}s", flush=True)
            if va_mae < best:
                best = va_mae
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    random.seed(args.seed)
    print(f"spawning {args.gpus} workers")
    mp.spawn(train_worker, args=(args), nprocs=args.gpus, join=True)
