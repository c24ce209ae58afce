"""GeoDiff-lite: graph-conditioned diffusion for conformer generation, launched with mp.spawn.

Our cluster nodes are used interactively through a job wrapper that only runs
`python script.py`, so processes are spawned from inside the script.

    python 17_conformer_diffusion_spawn.py --smiles_conf data/geom_drugs_subset.pkl --cache /shared/cache/geodiff \
        --gpus 8 --out /shared/runs/geodiff_lite
"""
import argparse
import datetime
import os
import pickle
import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Batch, Data
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

ATOMS = {"H": 0, "C": 1, "N": 2, "O": 3, "F": 4, "P": 5, "S": 6, "Cl": 7, "Br": 8, "I": 9}
BONDS = {Chem.BondType.SINGLE: 1, Chem.BondType.DOUBLE: 2, Chem.BondType.TRIPLE: 3, Chem.BondType.AROMATIC: 4}


def featurize(smiles, confs):
    mol = Chem.AddHs(Chem.MolFromSmiles(smiles))
    n = mol.GetNumAtoms()
    x = torch.tensor([ATOMS[a.GetSymbol()] for a in mol.GetAtoms()])
    full = torch.ones(n, n, dtype=torch.bool).fill_diagonal_(False).nonzero().t()
    btype = torch.zeros(n, n, dtype=torch.long)
    for b in mol.GetBonds():
        i, j = b.GetBeginAtomIdx(), b.GetEndAtomIdx()
        btype[i, j] = btype[j, i] = BONDS[b.GetBondType()]
    return Data(x=x, edge_index=full, edge_attr=btype[full[0], full[1]],
                confs=torch.stack([torch.as_tensor(c, dtype=torch.float) for c in confs]).unsqueeze(0),
                smiles=smiles, num_nodes=n)


class RandomConformerSet(torch.utils.data.Dataset):
    """One random reference conformer per molecule each time it is drawn."""

    def __init__(self, graphs):
        self.graphs = graphs

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        g = self.graphs[i]
        out = strip(g)
        out.pos = g.confs[0, random.randrange(g.confs.shape[1])]
        return out


def strip(g):
    out = g.clone()
    del out.confs
    return out


class GraphEGNN(nn.Module):
    def __init__(self, d=256, layers=6):
        super().__init__()
        self.atom = nn.Embedding(len(ATOMS), d)
        self.bond = nn.Embedding(5, d)
        self.t = nn.Linear(1, d)
        self.e = nn.ModuleList(nn.Sequential(nn.Linear(3 * d + 1, d), nn.SiLU(), nn.Linear(d, d), nn.SiLU())
                               for _ in range(layers))
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d)) for _ in range(layers))
        self.c = nn.ModuleList(nn.Linear(d, 1, bias=False) for _ in range(layers))

    def forward(self, pos, data, t):
        i, j = data.edge_index
        h = self.atom(data.x) + self.t(t[data.batch, None])
        eb = self.bond(data.edge_attr)
        x = pos
        for fe, fh, fc in zip(self.e, self.h, self.c):
            r = x[i] - x[j]
            d2 = (r ** 2).sum(-1, keepdim=True)
            m = fe(torch.cat([h[i], h[j], eb, d2], -1))
            h = h + fh(torch.cat([h, scatter(m, i, 0, dim_size=h.size(0)) / 30.0], -1))
            x = x + scatter(r / (d2.sqrt() + 1) * fc(m), i, 0, dim_size=x.size(0), reduce="mean")
        eps = x - pos
        return eps - scatter(eps, data.batch, 0, reduce="mean")[data.batch]


def center(x, b):
    return x - scatter(x, b, 0, reduce="mean")[b]


def ab_schedule(T, device):
    betas = torch.sigmoid(torch.linspace(-6, 6, T, device=device)) * (7e-3 - 1e-7) + 1e-7
    return torch.cumprod(1 - betas, 0), betas


def loss_fn(model, data, ab, T):
    t = torch.randint(0, T, (data.num_graphs,), device=data.pos.device)
    a = ab[t][data.batch, None]
    x0 = center(data.pos, data.batch)
    eps = center(torch.randn_like(x0), data.batch)
    pred = model(a.sqrt() * x0 + (1 - a).sqrt() * eps, data, t.float() / T)
    return F.mse_loss(pred, eps)


@torch.no_grad()
def generate(model, data, ab, betas):
    T = len(betas)
    x = center(torch.randn(data.num_nodes, 3, device=data.x.device), data.batch)
    for t in reversed(range(T)):
        eps = model(x, data, torch.full((data.num_graphs,), t / T, device=x.device))
        x = (x - betas[t] / (1 - ab[t]).sqrt() * eps) / (1 - betas[t]).sqrt()
        if t > 0:
            x = x + betas[t].sqrt() * center(torch.randn_like(x), data.batch)
    return x


def rmsd(a, b):
    a, b = a - a.mean(0), b - b.mean(0)
    U, _, Vt = torch.linalg.svd(a.T @ b)
    s = torch.linalg.det(U @ Vt).sign()
    U = torch.cat([U[:, :2], U[:, 2:] * s], 1)
    return ((a @ U @ Vt - b) ** 2).sum(-1).mean().sqrt()


def gather_variable(t, world):
    """all_gather for tensors whose first dim differs per rank: share sizes, pad, gather, trim."""
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


def worker(rank, world, args):
    torch.cuda.set_device(rank)
    # rank 0 may spend a while featurizing before the first barrier
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(hours=2))
    dev = torch.device("cuda", rank)
    random.seed(rank)
    torch.manual_seed(rank)

    cache = os.path.join(args.cache, "graphs.pt")
    if rank == 0 and not os.path.exists(cache):
        with open(args.smiles_conf, "rb") as f:
            raw = pickle.load(f)  # {"train": [(smiles, [confs])], "test": [...]}
        os.makedirs(args.cache, exist_ok=True)
        graphs = {k: [featurize(s, c) for s, c in v] for k, v in raw.items()}
        torch.save(graphs, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    graphs = torch.load(cache, map_location="cpu")
    train = RandomConformerSet(graphs["train"])
    test = graphs["test"][: args.n_test]

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)

    net = GraphEGNN().to(dev)
    model = DDP(net, device_ids=[rank])
    ema = GraphEGNN().to(dev).requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ab, betas = ab_schedule(args.T, dev)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            batch = batch.to(dev)
            loss = loss_fn(model, batch, ab, args.T)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), net.parameters()):
                    pe.lerp_(p, 1 - args.ema)

        if (epoch + 1) % args.eval_every == 0:
            # COV / MAT on test molecules, strided over ranks (counts differ per rank)
            mat, cov = [], []
            for g in test[rank::world]:
                refs = g.confs[0]
                n_gen = 2 * refs.shape[0]
                b = Batch.from_data_list([strip(g)] * n_gen).to(dev)
                gen = generate(ema, b, ab, betas).view(n_gen, -1, 3)
                R = torch.stack([torch.stack([rmsd(p, r.to(dev)) for p in gen]) for r in refs])
                mat.append(R.min(1).values.mean())
                cov.append((R.min(1).values < args.delta).float().mean())
            local = torch.stack([torch.stack(mat), torch.stack(cov)], 1) if mat else torch.zeros(0, 2, device=dev)
            allm = gather_variable(local, world)
            if rank == 0:
                print(f"epoch {epoch}: COV-R {allm[:, 1].mean():.3f}  MAT-R {allm[:, 0].mean():.3f} A "
                      f"(mean) {allm[:, 0].median():.3f} A (median), n={len(allm)}", flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smiles_conf", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--T", type=int, default=1000)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--n_test", type=int, default=200)
    ap.add_argument("--delta", type=float, default=1.25)
    ap.add_argument("--port", default="29533")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
