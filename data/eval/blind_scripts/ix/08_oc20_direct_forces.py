"""Direct-force model for OC20 S2EF with an energy-only warm start.

Forces are predicted by an equivariant edge head (sum_j f_ij * r_ij_hat) rather
than by differentiating the energy, which is ~3x cheaper per step.  For the first
`energy_only_epochs` epochs only the energy loss is used, so the trunk settles before the
force head starts pulling on it.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        08_oc20_direct_forces.py --config configs/direct_s2ef_all.yml
"""
import argparse
import math
import os
import pickle
from pathlib import Path

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter

from ocp_utils.graph import radius_graph_pbc, get_pbc_distances


class S2EFLmdb(Dataset):
    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*.lmdb"))
        self.lengths = []
        for f in self.files:
            env = lmdb.open(str(f), subdir=False, readonly=True, lock=False)
            self.lengths.append(env.stat()["entries"] - 1)
            env.close()
        self.cum = torch.tensor(self.lengths).cumsum(0).tolist()
        self._envs = None

    def __len__(self):
        return self.cum[-1]

    def __getitem__(self, idx):
        if self._envs is None:
            self._envs = [lmdb.open(str(f), subdir=False, readonly=True, lock=False, readahead=False,
                                    meminit=False, max_readers=1) for f in self.files]
        db = next(k for k, c in enumerate(self.cum) if idx < c)
        local = idx - (self.cum[db - 1] if db else 0)
        with self._envs[db].begin() as txn:
            return pickle.loads(txn.get(f"{local}".encode("ascii")))


class BesselBasis(nn.Module):
    def __init__(self, n, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.freq = nn.Parameter(torch.arange(1, n + 1).float() * math.pi)

    def forward(self, d):
        x = d.unsqueeze(-1) / self.cutoff
        return math.sqrt(2 / self.cutoff) * torch.sin(self.freq * x) / d.unsqueeze(-1)


class EdgeConv(nn.Module):
    def __init__(self, hidden, n_rbf):
        super().__init__()
        self.edge = nn.Sequential(nn.Linear(2 * hidden + n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.node = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h, edge_index, rbf, env):
        src, dst = edge_index
        m = self.edge(torch.cat([h[src], h[dst], rbf], -1)) * env.unsqueeze(-1)
        agg = scatter(m, dst, dim=0, dim_size=h.size(0))
        return h + self.node(torch.cat([self.norm(h), agg], -1)), m


class DirectForceNet(nn.Module):
    def __init__(self, hidden=256, n_layers=6, n_rbf=32, cutoff=6.0, max_neighbors=30):
        super().__init__()
        self.cutoff, self.max_neighbors = cutoff, max_neighbors
        self.atom_emb = nn.Embedding(90, hidden)
        self.rbf = BesselBasis(n_rbf, cutoff)
        self.layers = nn.ModuleList(EdgeConv(hidden, n_rbf) for _ in range(n_layers))
        self.energy_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
        self.force_head = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, data, with_forces=True):
        edge_index, cell_offsets, neighbors = radius_graph_pbc(data, self.cutoff, self.max_neighbors)
        out = get_pbc_distances(data.pos, edge_index, data.cell, cell_offsets, neighbors, return_distance_vec=True)
        edge_index, d, vec = out["edge_index"], out["distances"], out["distance_vec"]
        env = 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1.0)
        rbf = self.rbf(d)

        h = self.atom_emb(data.atomic_numbers.long())
        for layer in self.layers:
            h, m = layer(h, edge_index, rbf, env)
        energy = scatter(self.energy_head(h).squeeze(-1), data.batch, dim=0, dim_size=data.num_graphs)
        if not with_forces:
            return energy, None
        # vec points from target to source in the OCP convention
        f_ij = self.force_head(m) * (vec / d.unsqueeze(-1))
        forces = scatter(f_ij, edge_index[1], dim=0, dim_size=h.size(0))
        return energy, forces


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds = S2EFLmdb(cfg["dataset"]["train"]), S2EFLmdb(cfg["dataset"]["val"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0))
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["optim"]["batch_size"], sampler=train_sampler,
                              num_workers=cfg["optim"].get("num_workers", 8), pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=cfg["optim"]["eval_batch_size"], sampler=val_sampler, num_workers=4)

    net = DirectForceNet(**cfg["model"]).to(device)
    model = DDP(net, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["optim"]["lr"], weight_decay=cfg["optim"].get("weight_decay", 0.0))
    n_epochs = cfg["optim"]["max_epochs"]
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=n_epochs * len(train_loader), eta_min=1e-6)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    e_coef, f_coef = cfg["optim"].get("energy_coefficient", 1.0), cfg["optim"].get("force_coefficient", 100.0)
    energy_only_epochs = cfg["optim"].get("energy_only_epochs", 2)
    ckpt_dir = Path(cfg["checkpoint_dir"])
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, n_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        use_forces = epoch >= energy_only_epochs
        for it, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            energy, forces = model(batch, with_forces=use_forces)
            loss = e_coef * (energy - batch.y).abs().mean()
            if use_forces:
                free = batch.fixed == 0
                loss = loss + f_coef * (forces[free] - batch.force[free]).norm(dim=-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it} loss {loss.item():.4f} forces={use_forces}", flush=True)

        model.eval()
        acc = torch.zeros(4, device=device, dtype=torch.float64)
        with torch.no_grad():
            for batch in val_loader:
                batch = batch.to(device)
                energy, forces = net(batch)
                free = batch.fixed == 0
                acc += torch.stack([(energy - batch.y).abs().sum(), torch.tensor(float(batch.num_graphs), device=device),
                                    (forces[free] - batch.force[free]).abs().sum(), 3.0 * free.sum()]).double()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"[val] epoch {epoch} energy MAE {(acc[0] / acc[1]).item():.4f} eV "
                  f"force MAE {(acc[2] / acc[3]).item():.4f} eV/A", flush=True)
            torch.save({"state_dict": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "epoch": epoch, "config": cfg}, ckpt_dir / "checkpoint.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
