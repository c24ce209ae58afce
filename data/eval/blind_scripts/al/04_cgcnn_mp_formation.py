"""CGCNN-style crystal graph network for formation energy (Materials Project extxyz dump).

Periodic neighbour lists are built once with ASE and cached under <root>/processed/.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ase.io import read as ase_read
from ase.neighborlist import neighbor_list
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/mp_2018")
    p.add_argument("--split", default="data/mp_2018/split.npz")
    p.add_argument("--cutoff", type=float, default=8.0)
    p.add_argument("--max-neighbors", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--atom-fea", type=int, default=64)
    p.add_argument("--n-conv", type=int, default=4)
    p.add_argument("--workdir", default="runs/cgcnn_eform")
    return p.parse_args()


class CrystalGraphs(Dataset):
    def __init__(self, root, cutoff, max_nbr):
        self.cache = os.path.join(root, "processed", f"graphs_r{cutoff:g}_k{max_nbr}.pt")
        if os.path.exists(self.cache):
            self.graphs = torch.load(self.cache, map_location="cpu")
        else:
            self.graphs = self._process(root, cutoff, max_nbr)
            os.makedirs(os.path.dirname(self.cache), exist_ok=True)
            torch.save(self.graphs, self.cache)

    @staticmethod
    def _process(root, cutoff, max_nbr):
        frames = ase_read(os.path.join(root, "structures.extxyz"), index=":")
        graphs = []
        for atoms in tqdm(frames, desc="neighbour lists"):
            i, j, d = neighbor_list("ijd", atoms, cutoff)
            keep = []
            for a in range(len(atoms)):
                idx = np.nonzero(i == a)[0]
                keep.append(idx[np.argsort(d[idx])[:max_nbr]])
            keep = np.concatenate(keep)
            graphs.append({
                "z": torch.from_numpy(atoms.numbers.copy()).long(),
                "edge_index": torch.from_numpy(np.stack([i[keep], j[keep]])).long(),
                "dist": torch.from_numpy(d[keep]).float(),
                "y": torch.tensor(atoms.info["formation_energy_per_atom"], dtype=torch.float32),
            })
        return graphs

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def collate(batch):
    z, ei, d, gid, y = [], [], [], [], []
    off = 0
    for k, g in enumerate(batch):
        n = g["z"].numel()
        z.append(g["z"])
        ei.append(g["edge_index"] + off)
        d.append(g["dist"])
        gid.append(torch.full((n,), k, dtype=torch.long))
        y.append(g["y"])
        off += n
    return torch.cat(z), torch.cat(ei, 1), torch.cat(d), torch.cat(gid), torch.stack(y)


class GaussianExpansion(nn.Module):
    def __init__(self, dmax, n=41):
        super().__init__()
        self.register_buffer("mu", torch.linspace(0, dmax, n))
        self.var = (dmax / (n - 1)) ** 2

    def forward(self, d):
        return torch.exp(-((d[:, None] - self.mu) ** 2) / self.var)


class CGConv(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.fc = nn.Linear(2 * a + b, 2 * a)
        self.ln1 = nn.LayerNorm(2 * a)
        self.ln2 = nn.LayerNorm(a)

    def forward(self, h, ei, e):
        src, dst = ei
        z = self.ln1(self.fc(torch.cat([h[dst], h[src], e], -1)))
        gate, core = z.chunk(2, -1)
        msg = torch.sigmoid(gate) * F.softplus(core)
        out = torch.zeros_like(h).index_add_(0, dst, msg)
        return F.softplus(h + self.ln2(out))


class CGCNN(nn.Module):
    def __init__(self, atom_fea, n_conv, cutoff):
        super().__init__()
        self.emb = nn.Embedding(100, atom_fea)
        self.rbf = GaussianExpansion(cutoff)
        self.convs = nn.ModuleList([CGConv(atom_fea, 41) for _ in range(n_conv)])
        self.fc = nn.Sequential(nn.Linear(atom_fea, 128), nn.Softplus(), nn.Linear(128, 1))

    def forward(self, z, ei, d, gid, n_graphs):
        h = self.emb(z)
        e = self.rbf(d)
        for c in self.convs:
            h = c(h, ei, e)
        pooled = torch.zeros(n_graphs, h.shape[1], device=h.device).index_add_(0, gid, h)
        counts = torch.bincount(gid, minlength=n_graphs).clamp(min=1).unsqueeze(1)
        return self.fc(pooled / counts).squeeze(-1)


@torch.no_grad()
def run_eval(model, loader, dev):
    model.eval()
    s = torch.zeros(2, device=dev, dtype=torch.float64)
    for z, ei, d, gid, y in loader:
        z, ei, d, gid, y = (t.to(dev, non_blocking=True) for t in (z, ei, d, gid, y))
        pred = model(z, ei, d, gid, y.numel())
        s[0] += (pred - y).abs().sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse()
    lrank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lrank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", lrank)

    full = CrystalGraphs(args.root, args.cutoff, args.max_neighbors)
    split = np.load(args.split)
    train_set = Subset(full, split["train"].tolist())
    val_idx = split["val"].tolist()
    val_set = Subset(full, val_idx[rank::world])

    sampler = DistributedSampler(train_set, shuffle=True, seed=17)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, collate_fn=collate, num_workers=2)

    ys = torch.stack([full.graphs[i]["y"] for i in split["train"]])
    y_mean, y_std = ys.mean().item(), ys.std().item()

    net = CGCNN(args.atom_fea, args.n_conv, args.cutoff).to(dev)
    model = DDP(net, device_ids=[lrank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[300, 400], gamma=0.1)

    writer = SummaryWriter(args.workdir) if rank == 0 else None
    ck_file = os.path.join(args.workdir, "checkpoint.pth")
    start = 0
    best = float("inf")
    if os.path.exists(ck_file):
        ck = torch.load(ck_file, map_location=dev)
        net.load_state_dict(ck["net"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]

    for ep in range(start, args.epochs):
        sampler.set_epoch(ep)
        tic = time.time()
        acc = torch.zeros(2, device=dev)
        for z, ei, d, gid, y in train_loader:
            z, ei, d, gid, y = (t.to(dev, non_blocking=True) for t in (z, ei, d, gid, y))
            pred = model(z, ei, d, gid, y.numel())
            loss = F.mse_loss(pred, (y - y_mean) / y_std)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=dev)])
        sched.step()
        dist.all_reduce(acc)

        net_eval = _DenormWrapper(net, y_mean, y_std)
        mae = run_eval(net_eval, val_loader, dev)
        if rank == 0:
            writer.add_scalar("train/mse", (acc[0] / acc[1]).item(), ep)
            writer.add_scalar("val/mae_eV_per_atom", mae, ep)
            print(f"epoch {ep} val MAE {mae:.4f} eV/atom ({time.time() - tic:.1f}s)", flush=True)
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": ep, "best": min(best, mae), "y_mean": y_mean, "y_std": y_std}, ck_file)
            if mae < best:
                torch.save({"net": net.state_dict(), "y_mean": y_mean, "y_std": y_std},
                           os.path.join(args.workdir, "model_best.pth"))
        best = min(best, mae)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


class _DenormWrapper(nn.Module):
    def __init__(self, net, mean, std):
        super().__init__()
        self.net, self.mean, self.std = net, mean, std

    def forward(self, *a):
        return self.net(*a) * self.std + self.mean


if __name__ == "__main__":
    main()
