"""
Multi-task toxicity (Tox21, 12 assays) with an edge-aware message passing network.
SMILES are featurised with RDKit once and cached next to the CSV.

    torchrun --standalone --nproc_per_node=4 18_tox21_mpnn_featurize_cache.py \
        --csv data/tox21_scaffold_{split}.csv --cache-dir data/cache
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem
from rdkit import RDLogger
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
TASKS = ["NR-AR", "NR-AR-LBD", "NR-AhR", "NR-Aromatase", "NR-ER", "NR-ER-LBD", "NR-PPAR-gamma",
         "SR-ARE", "SR-ATAD5", "SR-HSE", "SR-MMP", "SR-p53"]
ATOMS = [6, 7, 8, 9, 15, 16, 17, 35, 53, 5, 14, 34, 11, 19, 26, 29, 30]
BONDS = [Chem.BondType.SINGLE, Chem.BondType.DOUBLE, Chem.BondType.TRIPLE, Chem.BondType.AROMATIC]


def one_hot(v, choices):
    out = [0.0] * (len(choices) + 1)
    out[choices.index(v) if v in choices else -1] = 1.0
    return out


def featurize(smiles, labels):
    mol = Chem.MolFromSmiles(smiles)
    if mol is None or mol.GetNumAtoms() == 0:
        return None
    x = [one_hot(a.GetAtomicNum(), ATOMS) + one_hot(a.GetDegree(), [0, 1, 2, 3, 4, 5])
         + one_hot(a.GetFormalCharge(), [-1, 0, 1]) + one_hot(int(a.GetHybridization()), [1, 2, 3, 4, 5])
         + [float(a.GetIsAromatic()), a.GetTotalNumHs() / 4.0] for a in mol.GetAtoms()]
    src, dst, ea = [], [], []
    for b in mol.GetBonds():
        i, j = b.GetBeginAtomIdx(), b.GetEndAtomIdx()
        f = one_hot(b.GetBondType(), BONDS) + [float(b.GetIsConjugated()), float(b.IsInRing())]
        src += [i, j]; dst += [j, i]; ea += [f, f]
    return {"x": torch.tensor(x), "edge_index": torch.tensor([src, dst], dtype=torch.long).view(2, -1),
            "edge_attr": torch.tensor(ea).view(-1, len(BONDS) + 3), "y": torch.tensor(labels, dtype=torch.float32)}


class Tox21Graphs(Dataset):
    def __init__(self, csv_path, cache_dir):
        cache = os.path.join(cache_dir, os.path.basename(csv_path).replace(".csv", ".graphs.pt"))
        if os.path.exists(cache):
            self.graphs = torch.load(cache)
        else:
            df = pd.read_csv(csv_path)
            labels = df[TASKS].values.astype(np.float32)            # NaN = not measured
            graphs = (featurize(s, y) for s, y in zip(df["smiles"], labels))
            self.graphs = [g for g in graphs if g is not None]
            os.makedirs(cache_dir, exist_ok=True)
            torch.save(self.graphs, cache)

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def collate(batch):
    xs, eis, eas, ys, bidx, off = [], [], [], [], [], 0
    for k, g in enumerate(batch):
        xs.append(g["x"]); eis.append(g["edge_index"] + off); eas.append(g["edge_attr"]); ys.append(g["y"])
        bidx.append(torch.full((g["x"].shape[0],), k, dtype=torch.long))
        off += g["x"].shape[0]
    return torch.cat(xs), torch.cat(eis, 1), torch.cat(eas), torch.cat(bidx), torch.stack(ys)


class EdgeMPNN(nn.Module):
    def __init__(self, node_in, edge_in, hidden=300, steps=5, n_tasks=12):
        super().__init__()
        self.inp = nn.Linear(node_in, hidden)
        self.edge_nets = nn.ModuleList([nn.Linear(edge_in, hidden) for _ in range(steps)])
        self.updates = nn.ModuleList([nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
                                      for _ in range(steps)])
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(steps)])
        self.readout = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, n_tasks))

    def forward(self, x, edge_index, edge_attr, batch, n_graphs):
        h = F.relu(self.inp(x))
        src, dst = edge_index
        for enet, upd, norm in zip(self.edge_nets, self.updates, self.norms):
            msg = F.relu(h[src] + enet(edge_attr))
            agg = torch.zeros_like(h).index_add_(0, dst, msg)
            h = norm(h + upd(agg))
        s = torch.zeros(n_graphs, h.shape[1], device=h.device).index_add_(0, batch, h)
        m = torch.full((n_graphs, h.shape[1]), -1e4, device=h.device).index_reduce_(0, batch, h, "amax")
        return self.readout(torch.cat([s, m], dim=1))


def masked_bce(logits, y):
    mask = ~torch.isnan(y)
    return F.binary_cross_entropy_with_logits(logits[mask], y[mask])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    outs = []
    for x, ei, ea, b, y in loader:
        logits = model(x.to(device), ei.to(device), ea.to(device), b.to(device), y.shape[0])
        outs.append(torch.cat([torch.sigmoid(logits), y.to(device)], dim=1))
    local = torch.cat(outs)                                   # equal length on all ranks (sampler pads)
    full = torch.empty(dist.get_world_size() * local.shape[0], local.shape[1], device=device)
    dist.all_gather_into_tensor(full, local)
    full = full.cpu().numpy()
    p, y = full[:, :len(TASKS)], full[:, len(TASKS):]
    aucs = []
    for t in range(len(TASKS)):
        m = ~np.isnan(y[:, t])
        if m.sum() > 0 and len(np.unique(y[m, t])) == 2:
            aucs.append(roc_auc_score(y[m, t], p[m, t]))
    return float(np.mean(aucs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="data/tox21_scaffold_{split}.csv")
    ap.add_argument("--cache-dir", default="data/cache")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--out", default="ckpt/tox21_mpnn.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_set = Tox21Graphs(args.csv.format(split="train"), args.cache_dir)
    val_set = Tox21Graphs(args.csv.format(split="valid"), args.cache_dir)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler, collate_fn=collate, num_workers=2)

    g0 = train_set[0]
    torch.manual_seed(0)
    model = EdgeMPNN(g0["x"].shape[1], g0["edge_attr"].shape[1]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, run = time.time(), torch.zeros(2, device=device)
        for x, ei, ea, b, y in train_loader:
            x, ei, ea, b, y = (t.to(device, non_blocking=True) for t in (x, ei, ea, b, y))
            loss = masked_bce(model(x, ei, ea, b, y.shape[0]), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        auc = evaluate(model, val_loader, device)
        sched.step(auc)
        if rank == 0:
            print(f"epoch {epoch:3d} loss {(run[0] / run[1]).item():.4f} val ROC-AUC {auc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if auc > best:
                best = auc
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc}, args.out)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
