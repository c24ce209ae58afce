#!/usr/bin/env python
# EDM-style equivariant diffusion on GEOM/QM9 with PyG batching.
# Periodically samples molecules on every rank (EMA weights) and computes
# RDKit validity / uniqueness on the gathered set.
#
#   torchrun --nnodes=1 --nproc_per_node=4 02_edm_pyg_sampling_eval.py --root data/qm9 --out ckpt/edm_pyg
import argparse
import os
import copy
import datetime
import math
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.data import Data, Batch
from torch_geometric.utils import scatter

from rdkit import Chem, RDLogger
from rdkit.Chem import rdDetermineBonds

RDLogger.DisableLog("rdApp.*")
log = logging.getLogger("edm")
Z_VOCAB = [1, 6, 7, 8, 9]
Z_TO_IDX = {z: i for i, z in enumerate(Z_VOCAB)}


def full_edges(batch_vec):
    # all ordered pairs i != j inside each graph
    same = batch_vec.unsqueeze(0) == batch_vec.unsqueeze(1)
    same.fill_diagonal_(False)
    return same.nonzero().t()


def center(x, batch_vec):
    return x - scatter(x, batch_vec, dim=0, reduce="mean")[batch_vec]


class EGCL(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.phi_e = nn.Sequential(nn.Linear(2 * h + 1, h), nn.SiLU(), nn.Linear(h, h), nn.SiLU())
        self.phi_h = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))
        self.phi_x = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))

    def forward(self, h, x, ei):
        r, c = ei
        diff = x[r] - x[c]
        d2 = (diff ** 2).sum(-1, keepdim=True)
        m = self.phi_e(torch.cat([h[r], h[c], d2], -1))
        agg = scatter(m, r, dim=0, dim_size=h.shape[0], reduce="sum") / 100.0
        h = h + self.phi_h(torch.cat([h, agg], -1))
        w = self.phi_x(m)
        x = x + scatter(diff / (d2.sqrt() + 1.0) * w, r, dim=0, dim_size=x.shape[0], reduce="sum") / 100.0
        return h, x


class EDMNet(nn.Module):
    def __init__(self, n_types=5, hidden=192, n_layers=8):
        super().__init__()
        self.n_types = n_types
        self.inp = nn.Linear(n_types + 1, hidden)
        self.blocks = nn.ModuleList([EGCL(hidden) for _ in range(n_layers)])
        self.out_h = nn.Linear(hidden, n_types)

    def forward(self, x, h, t_node, ei, batch_vec):
        hh = self.inp(torch.cat([h, t_node.unsqueeze(-1)], -1))
        xx = x
        for blk in self.blocks:
            hh, xx = blk(hh, xx, ei)
        return center(xx - x, batch_vec), self.out_h(hh)


class Schedule:
    def __init__(self, T, device):
        s = 1e-5
        t = torch.linspace(0, 1, T + 1, device=device)
        self.alpha2 = ((1 - 2 * s) * (1 - t ** 2) ** 2 + s)  # polynomial_2 schedule from EDM
        self.T = T


def loss_fn(net, batch, sch):
    bv = batch.batch
    B = int(bv.max()) + 1
    t = torch.randint(1, sch.T + 1, (B,), device=bv.device)
    a2 = sch.alpha2[t][bv].unsqueeze(-1)
    x0 = center(batch.pos, bv)
    h0 = batch.h
    ex = center(torch.randn_like(x0), bv)
    eh = torch.randn_like(h0)
    xt = a2.sqrt() * x0 + (1 - a2).sqrt() * ex
    ht = a2.sqrt() * h0 + (1 - a2).sqrt() * eh
    px, ph = net(xt, ht, (t.float() / sch.T)[bv], batch.edge_index, bv)
    return F.mse_loss(torch.cat([px, ph], -1), torch.cat([ex, eh], -1))


@torch.no_grad()
def sample(net, n_nodes, sch, device):
    bv = torch.repeat_interleave(torch.arange(len(n_nodes), device=device), n_nodes.to(device))
    ei = full_edges(bv)
    x = center(torch.randn(bv.shape[0], 3, device=device), bv)
    h = torch.randn(bv.shape[0], net.n_types, device=device)
    for s in range(sch.T, 0, -1):
        a_t, a_s = sch.alpha2[s], sch.alpha2[s - 1]
        ex, eh = net(x, h, torch.full_like(bv, s, dtype=torch.float) / sch.T, ei, bv)
        ab = a_t / a_s
        sig2 = (1 - ab) * (1 - a_s) / (1 - a_t)
        x = (x - (1 - ab) / (1 - a_t).sqrt() * ex) / ab.sqrt()
        h = (h - (1 - ab) / (1 - a_t).sqrt() * eh) / ab.sqrt()
        if s > 1:
            x = x + sig2.sqrt() * center(torch.randn_like(x), bv)
            h = h + sig2.sqrt() * torch.randn_like(h)
    mols = []
    for i in range(len(n_nodes)):
        sel = bv == i
        mols.append((x[sel].cpu(), h[sel].argmax(-1).cpu()))
    return mols


def to_smiles(pos, types):
    xyz = [f"{len(types)}", ""]
    for p, t in zip(pos.tolist(), types.tolist()):
        xyz.append(f"{Chem.GetPeriodicTable().GetElementSymbol(Z_VOCAB[t])} {p[0]:.4f} {p[1]:.4f} {p[2]:.4f}")
    try:
        mol = Chem.MolFromXYZBlock("\n".join(xyz))
        rdDetermineBonds.DetermineBonds(mol, charge=0)
        Chem.SanitizeMol(mol)
        frags = Chem.GetMolFrags(mol, asMols=True)
        return Chem.MolToSmiles(max(frags, key=lambda m: m.GetNumAtoms()))
    except Exception:
        return None


class ToEDM:
    def __call__(self, d):
        idx = torch.tensor([Z_TO_IDX[int(z)] for z in d.z])
        n = d.z.shape[0]
        ei = torch.ones(n, n, dtype=torch.bool).fill_diagonal_(False).nonzero().t()
        return Data(pos=d.pos, h=F.one_hot(idx, 5).float() * 0.25, edge_index=ei, num_nodes=n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/qm9")
    ap.add_argument("--out", default="ckpt/edm_pyg")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=96)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--T", type=int, default=500)
    ap.add_argument("--ema_decay", type=float, default=0.9995)
    ap.add_argument("--n_eval_samples", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    # PyG processes the raw files on first use; let rank 0 do it alone
    if rank == 0:
        QM9(args.root)
    dist.barrier()
    ds = QM9(args.root, transform=ToEDM())
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))
    train_ds, val_ds = Subset(ds, perm[:-10000].tolist()), Subset(ds, perm[-10000:].tolist())
    # validation: strided shard per rank, no padding duplicates
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))

    n_hist = torch.bincount(ds.slices["z"].diff(), minlength=30).float()

    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True)
    val_dl = DataLoader(val_shard, batch_size=args.bs, num_workers=2)

    net = EDMNet().to(device)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-12)
    sch = Schedule(args.T, device)

    epoch0 = 0
    if args.resume:
        st = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(st["net"])
        ema.load_state_dict(st["ema"])
        opt.load_state_dict(st["opt"])
        epoch0 = st["epoch"] + 1

    # weights are identical everywhere (same default init, then DDP broadcast);
    # from here on each rank draws its own timesteps / noise / samples
    gen_seed = 1234 + rank
    torch.manual_seed(gen_seed)

    for epoch in range(epoch0, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = batch.to(device, non_blocking=True)
            loss = loss_fn(model, batch, sch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema_decay)

        # validation loss with EMA weights
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for vb in val_dl:
                vb = vb.to(device)
                acc[0] += loss_fn(ema, vb, sch) * vb.num_graphs
                acc[1] += vb.num_graphs
        dist.all_reduce(acc, op=dist.ReduceOp.SUM)
        if rank == 0:
            log.info("epoch %d val_loss %.5f", epoch, (acc[0] / acc[1]).item())

        if (epoch + 1) % args.eval_every == 0:
            torch.manual_seed(gen_seed + epoch)
            per_rank = math.ceil(args.n_eval_samples / world)
            n_nodes = torch.multinomial(n_hist, per_rank, replacement=True)
            mols = []
            for chunk in n_nodes.split(100):
                mols += sample(ema, chunk, sch, device)
            smiles = [to_smiles(p, t) for p, t in mols]
            gathered = [None] * world
            dist.all_gather_object(gathered, smiles)
            if rank == 0:
                allsmi = [s for part in gathered for s in part][: args.n_eval_samples]
                valid = [s for s in allsmi if s is not None]
                log.info("epoch %d validity %.3f uniqueness %.3f (n=%d)", epoch,
                         len(valid) / len(allsmi), len(set(valid)) / max(len(valid), 1), len(allsmi))

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            tmp = os.path.join(args.out, "last.pt.tmp")
            torch.save({"net": net.state_dict(), "ema": ema.state_dict(),
                        "opt": opt.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
