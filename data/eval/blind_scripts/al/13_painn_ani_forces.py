"""PaiNN interatomic potential (energy + forces) on an extxyz dataset, DDP + gradient accumulation.

    torchrun --nproc_per_node=8 13_painn_ani_forces.py --xyz data/ani1x_subset.extxyz --accum 2
"""
import argparse
import datetime
import math
import os
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ase.io import iread
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def build_cache(xyz, cutoff, cache):
    graphs = []
    for at in iread(xyz, index=":"):
        pos = torch.tensor(at.get_positions(), dtype=torch.float32)
        d = torch.cdist(pos, pos)
        src, dst = torch.nonzero((d < cutoff) & (d > 0), as_tuple=True)
        graphs.append({"z": torch.tensor(at.numbers), "pos": pos, "edge_index": torch.stack([src, dst]),
                       "energy": torch.tensor(at.info["energy"], dtype=torch.float32),
                       "forces": torch.tensor(at.arrays["forces"], dtype=torch.float32)})
    tmp = cache + f".tmp{os.getpid()}"
    torch.save(graphs, tmp)
    os.replace(tmp, cache)


def collate(items):
    out = {"z": [], "pos": [], "edge_index": [], "batch": [], "energy": [], "forces": []}
    off = 0
    for i, g in enumerate(items):
        n = g["z"].numel()
        out["z"].append(g["z"])
        out["pos"].append(g["pos"])
        out["edge_index"].append(g["edge_index"] + off)
        out["batch"].append(torch.full((n,), i))
        out["energy"].append(g["energy"])
        out["forces"].append(g["forces"])
        off += n
    out = {k: torch.cat(v, 1 if k == "edge_index" else 0) if k != "energy" else torch.stack(v) for k, v in out.items()}
    out["n_graphs"] = len(items)
    return out


def rbf(d, n, cutoff):
    k = torch.arange(1, n + 1, device=d.device) * math.pi / cutoff
    return torch.sin(k * d.unsqueeze(-1)) / d.unsqueeze(-1)


def cutoff_fn(d, c):
    return 0.5 * (torch.cos(math.pi * d / c) + 1) * (d < c)


class Message(nn.Module):
    def __init__(self, f, n_rbf, cutoff):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 3 * f))
        self.W = nn.Linear(n_rbf, 3 * f)
        self.n_rbf, self.cutoff = n_rbf, cutoff

    def forward(self, s, v, ei, r_ij, d):
        src, dst = ei
        x = self.phi(s)[src] * self.W(rbf(d, self.n_rbf, self.cutoff)) * cutoff_fn(d, self.cutoff).unsqueeze(-1)
        ds, dvv, dvs = x.chunk(3, -1)
        dv = v[src] * dvv.unsqueeze(1) + dvs.unsqueeze(1) * (r_ij / d.unsqueeze(-1)).unsqueeze(-1)
        return s + torch.zeros_like(s).index_add_(0, dst, ds), v + torch.zeros_like(v).index_add_(0, dst, dv)


class Update(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.U = nn.Linear(f, f, bias=False)
        self.V = nn.Linear(f, f, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * f, f), nn.SiLU(), nn.Linear(f, 3 * f))

    def forward(self, s, v):
        Uv, Vv = self.U(v), self.V(v)
        a = self.mlp(torch.cat([s, torch.sqrt((Vv ** 2).sum(1) + 1e-8)], -1))
        avv, asv, ass = a.chunk(3, -1)
        return s + asv * (Uv * Vv).sum(1) + ass, v + avv.unsqueeze(1) * Uv


class PaiNN(nn.Module):
    def __init__(self, f=128, n_layers=3, n_rbf=20, cutoff=5.0, n_species=100):
        super().__init__()
        self.f = f
        self.embed = nn.Embedding(n_species, f)
        self.msg = nn.ModuleList([Message(f, n_rbf, cutoff) for _ in range(n_layers)])
        self.upd = nn.ModuleList([Update(f) for _ in range(n_layers)])
        self.out = nn.Sequential(nn.Linear(f, f // 2), nn.SiLU(), nn.Linear(f // 2, 1))
        self.register_buffer("atom_ref", torch.zeros(n_species))
        self.scale = 1.0

    def forward(self, z, pos, ei, batch, n_graphs):
        src, dst = ei
        r_ij = pos[dst] - pos[src]
        d = r_ij.norm(dim=-1)
        s = self.embed(z)
        v = torch.zeros(s.shape[0], 3, self.f, device=s.device, dtype=s.dtype)
        for m, u in zip(self.msg, self.upd):
            s, v = m(s, v, ei, r_ij, d)
            s, v = u(s, v)
        e = self.out(s).squeeze(-1) * self.scale + self.atom_ref[z]
        return torch.zeros(n_graphs, device=pos.device, dtype=e.dtype).index_add_(0, batch, e)


def predict(model, b):
    pos = b["pos"].requires_grad_(True)
    e = model(b["z"], pos, b["edge_index"], b["batch"], b["n_graphs"])
    f = -torch.autograd.grad(e.sum(), pos, create_graph=torch.is_grad_enabled() and model.training)[0]
    return e, f


def fit_atom_ref(graphs, n_species=100):
    counts = np.zeros((len(graphs), n_species))
    for i, g in enumerate(graphs):
        counts[i] = np.bincount(g["z"].numpy(), minlength=n_species)
    e = np.array([g["energy"].item() for g in graphs])
    used = counts.sum(0) > 0
    sol, *_ = np.linalg.lstsq(counts[:, used], e, rcond=None)
    ref = np.zeros(n_species)
    ref[used] = sol
    resid = e - counts @ ref
    return torch.tensor(ref, dtype=torch.float32), float(np.sqrt((resid ** 2).mean() / counts.sum(1).mean()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--xyz", required=True)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--w-energy", type=float, default=0.05)
    ap.add_argument("--w-forces", type=float, default=0.95)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--out", default="runs/painn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 may spend a while building the neighbour-list cache below
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    cache = os.path.splitext(args.xyz)[0] + f"_r{args.cutoff:g}.pt"
    if rank == 0 and not os.path.exists(cache):
        build_cache(args.xyz, args.cutoff, cache)
    dist.barrier()
    graphs = torch.load(cache, map_location="cpu")

    perm = torch.randperm(len(graphs), generator=torch.Generator().manual_seed(1234)).tolist()
    n_val = int(len(graphs) * args.val_frac)
    train_idx, val_idx = perm[n_val:], perm[:n_val]
    train_set = Subset(graphs, train_idx)
    val_set = Subset(graphs, val_idx[rank::world])

    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_dl = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_set, batch_size=32, collate_fn=collate, num_workers=2)

    net = PaiNN(cutoff=args.cutoff)
    ref, scale = fit_atom_ref([graphs[i] for i in train_idx])
    net.atom_ref.copy_(ref)
    net.scale = scale
    net = net.to(dev)
    model = DDP(net, device_ids=[local_rank])
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=5)

    os.makedirs(args.out, exist_ok=True)
    ck_path = os.path.join(args.out, "checkpoint.pt")
    start = 0
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for i, b in enumerate(train_dl):
            b = {k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in b.items()}
            last_micro = (i + 1) % args.accum == 0 or (i + 1) == len(train_dl)
            with nullcontext() if last_micro else model.no_sync():
                e, f = predict(model, b)
                n_at = torch.bincount(b["batch"], minlength=b["n_graphs"]).float()
                loss = args.w_energy * F.mse_loss(e / n_at, b["energy"] / n_at) + args.w_forces * F.mse_loss(f, b["forces"])
                (loss / args.accum).backward()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                ema.update_parameters(net)

        ema.module.eval()
        acc = torch.zeros(4, device=dev, dtype=torch.float64)
        for b in val_dl:
            b = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in b.items()}
            e, f = predict(ema.module, b)
            acc += torch.stack([(e.detach() - b["energy"]).abs().sum(), torch.tensor(float(b["n_graphs"]), device=dev),
                                (f.detach() - b["forces"]).abs().sum(), torch.tensor(float(f.numel()), device=dev)]).double()
        dist.all_reduce(acc)
        e_mae, f_mae = (acc[0] / acc[1]).item(), (acc[2] / acc[3]).item()
        sched.step(args.w_energy * e_mae + args.w_forces * f_mae)

        if rank == 0:
            print(f"epoch {epoch} | E MAE {e_mae * 1000:.2f} meV  F MAE {f_mae * 1000:.2f} meV/A | "
                  f"lr {opt.param_groups[0]['lr']:.2e} | {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch}, ck_path)
        dist.barrier()
        if opt.param_groups[0]["lr"] < 1e-6:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
