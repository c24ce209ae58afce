"""PaiNN energy + force training on OC20 S2EF (LMDB format), multi-node DDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29400 02_oc20_s2ef_painn.py --config configs/painn_s2ef_2M.yaml
"""
import argparse
import bisect
import math
import os
import pickle
import time
from pathlib import Path

import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter

from graph_utils import radius_graph_pbc  # shared OC20 helper (pbc neighbor search, max_neighbors trimming)


class LmdbDataset(Dataset):
    def __init__(self, src):
        src = Path(src)
        self.paths = sorted(src.glob("*.lmdb")) if src.is_dir() else [src]
        self.envs = None
        sizes = []
        for p in self.paths:
            env = self._open(p)
            sizes.append(env.stat()["entries"] - 1)  # minus the "length" key
            env.close()
        self.offsets = np.cumsum(sizes).tolist()

    @staticmethod
    def _open(path):
        return lmdb.open(str(path), subdir=False, readonly=True, lock=False,
                         readahead=False, meminit=False, max_readers=1)

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, idx):
        if self.envs is None:
            self.envs = [self._open(p) for p in self.paths]
        db = bisect.bisect_right(self.offsets, idx)
        local = idx if db == 0 else idx - self.offsets[db - 1]
        with self.envs[db].begin(write=False) as txn:
            return pickle.loads(txn.get(str(local).encode("ascii")))


def sinc_rbf(d, num_rbf, cutoff):
    n = torch.arange(1, num_rbf + 1, device=d.device, dtype=d.dtype)
    return torch.sin(n * math.pi * d.unsqueeze(-1) / cutoff) / d.unsqueeze(-1)


def cosine_cutoff(d, cutoff):
    return 0.5 * (torch.cos(d * math.pi / cutoff) + 1.0) * (d < cutoff).to(d.dtype)


class PaiNNMessage(nn.Module):
    def __init__(self, hidden, num_rbf):
        super().__init__()
        self.hidden = hidden
        self.phi = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3 * hidden))
        self.w = nn.Linear(num_rbf, 3 * hidden)

    def forward(self, s, v, edge_index, unit, rbf, fcut):
        src, dst = edge_index
        x = self.phi(s)[src] * self.w(rbf) * fcut.unsqueeze(-1)
        ds, dv_v, dv_s = torch.split(x, self.hidden, dim=-1)
        dv = v[src] * dv_v.unsqueeze(1) + dv_s.unsqueeze(1) * unit.unsqueeze(-1)
        s = s + scatter(ds, dst, dim=0, dim_size=s.size(0))
        v = v + scatter(dv, dst, dim=0, dim_size=v.size(0))
        return s, v


class PaiNNUpdate(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden
        self.U = nn.Linear(hidden, hidden, bias=False)
        self.V = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, 3 * hidden))

    def forward(self, s, v):
        Uv, Vv = self.U(v), self.V(v)
        vnorm = torch.sqrt((Vv ** 2).sum(dim=1) + 1e-8)
        a_vv, a_sv, a_ss = torch.split(self.mlp(torch.cat([s, vnorm], -1)), self.hidden, dim=-1)
        return s + a_sv * (Uv * Vv).sum(dim=1) + a_ss, v + a_vv.unsqueeze(1) * Uv


class PaiNN(nn.Module):
    def __init__(self, hidden=512, num_layers=6, num_rbf=128, cutoff=12.0, max_neighbors=50):
        super().__init__()
        self.hidden, self.cutoff, self.num_rbf, self.max_neighbors = hidden, cutoff, num_rbf, max_neighbors
        self.embedding = nn.Embedding(100, hidden)
        self.messages = nn.ModuleList([PaiNNMessage(hidden, num_rbf) for _ in range(num_layers)])
        self.updates = nn.ModuleList([PaiNNUpdate(hidden) for _ in range(num_layers)])
        self.out = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))

    def forward(self, data):
        pos = data.pos
        edge_index, shift = radius_graph_pbc(data, self.cutoff, self.max_neighbors)
        vec = pos[edge_index[0]] + shift - pos[edge_index[1]]
        d = vec.norm(dim=-1)
        rbf, fcut, unit = sinc_rbf(d, self.num_rbf, self.cutoff), cosine_cutoff(d, self.cutoff), vec / d.unsqueeze(-1)

        s = self.embedding(data.atomic_numbers.long())
        v = s.new_zeros(s.size(0), 3, self.hidden)
        for msg, upd in zip(self.messages, self.updates):
            s, v = msg(s, v, edge_index, unit, rbf, fcut)
            s, v = upd(s, v)
        return scatter(self.out(s).squeeze(-1), data.batch, dim=0, dim_size=data.num_graphs)


def energy_and_forces(model, data, scale):
    data.pos.requires_grad_(True)
    energy = model(data)
    forces = -torch.autograd.grad(energy.sum(), data.pos, create_graph=model.training)[0]
    return energy * scale, forces * scale


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    train_set = LmdbDataset(cfg["train_src"])
    val_set = LmdbDataset(cfg["val_src"])
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg.get("num_workers", 8), pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=cfg["eval_batch_size"], sampler=val_sampler, num_workers=4)

    model = PaiNN(**cfg["model"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    total_steps = cfg["epochs"] * len(train_loader)
    warmup = cfg.get("warmup_steps", 1000)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    scale, fw = cfg.get("energy_scale", 1.0), cfg.get("force_coefficient", 100.0)
    out_dir = Path(cfg["out_dir"])
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        skipped = 0
        for batch in train_loader:
            if int(batch.natoms.sum()) > cfg["max_atoms_per_batch"]:
                skipped += 1
                continue
            batch = batch.to(device, non_blocking=True)
            energy, forces = energy_and_forces(model, batch, scale)
            free = batch.fixed == 0
            e_loss = (energy - batch.y).abs().mean()
            f_loss = (forces[free] - batch.force[free]).norm(dim=-1).mean()  # per-atom L2 (OCP "l2mae")
            loss = e_loss + fw * f_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("clip_grad_norm", 10.0))
            optimizer.step()
            scheduler.step()
            step += 1
            if rank == 0 and step % cfg.get("log_every", 100) == 0:
                print(f"ep {epoch} step {step} e_loss {e_loss.item():.4f} f_loss {f_loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

        # validation: energy MAE per system, force MAE per free atom component
        model.eval()
        sums = torch.zeros(4, device=device, dtype=torch.float64)
        for batch in val_loader:
            batch = batch.to(device)
            with torch.enable_grad():
                energy, forces = energy_and_forces(model.module, batch, scale)
            free = batch.fixed == 0
            sums[0] += (energy.detach() - batch.y).abs().sum()
            sums[1] += batch.num_graphs
            sums[2] += (forces.detach()[free] - batch.force[free]).abs().sum()
            sums[3] += 3 * free.sum()
        dist.all_reduce(sums)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s (skipped {skipped} oversized batches) | "
                  f"val energy MAE {sums[0] / sums[1]:.4f} eV | force MAE {sums[2] / sums[3]:.4f} eV/A", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "config": cfg},
                       out_dir / f"checkpoint_{epoch:03d}.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
