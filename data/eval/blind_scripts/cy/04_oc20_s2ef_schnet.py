"""SchNet-style S2EF baseline on OC20 (energy + gradient forces).

Reads the preprocessed OC20 LMDBs (with edge_index / cell_offsets stored per
frame, r_edges=True) and trains with DDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        04_oc20_s2ef_schnet.py --config configs/s2ef_2M_schnet.yml
"""
import argparse
import bisect
import glob
import math
import os
import pickle
import time

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader


class LmdbDataset(Dataset):
    """All *.lmdb files of a folder, opened lazily in every DataLoader worker."""

    def __init__(self, path):
        self.paths = sorted(glob.glob(os.path.join(path, "*.lmdb")))
        self.envs = None
        lengths = []
        for p in self.paths:
            env = self._open(p)
            with env.begin() as txn:
                lengths.append(pickle.loads(txn.get(b"length")))
            env.close()
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)

    @staticmethod
    def _open(p):
        return lmdb.open(p, subdir=False, readonly=True, lock=False, readahead=False,
                         meminit=False, max_readers=1)

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, idx):
        if self.envs is None:
            self.envs = [self._open(p) for p in self.paths]
        db = bisect.bisect_right(self.offsets, idx) - 1
        key = f"{idx - self.offsets[db]}".encode("ascii")
        with self.envs[db].begin() as txn:
            data = pickle.loads(txn.get(key))
        data.atomic_numbers = data.atomic_numbers.long()
        return data


class ShiftedSoftplus(nn.Module):
    def forward(self, x):
        return nn.functional.softplus(x) - math.log(2.0)


class Interaction(nn.Module):
    def __init__(self, hidden, filters, n_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.filter_net = nn.Sequential(nn.Linear(n_rbf, filters), ShiftedSoftplus(), nn.Linear(filters, filters))
        self.lin_in = nn.Linear(hidden, filters, bias=False)
        self.lin_out = nn.Sequential(nn.Linear(filters, hidden), ShiftedSoftplus(), nn.Linear(hidden, hidden))

    def forward(self, h, edge_index, d, rbf):
        i, j = edge_index
        c = 0.5 * (torch.cos(d * math.pi / self.cutoff) + 1.0)
        w = self.filter_net(rbf) * c.unsqueeze(-1)
        x = self.lin_in(h)
        m = torch.zeros_like(x).index_add_(0, i, x[j] * w)
        return h + self.lin_out(m)


class SchNetPBC(nn.Module):
    def __init__(self, hidden=512, filters=256, interactions=5, n_rbf=200, cutoff=6.0):
        super().__init__()
        self.embedding = nn.Embedding(100, hidden)
        self.register_buffer("centers", torch.linspace(0.0, cutoff, n_rbf))
        self.gamma = 0.5 / (cutoff / (n_rbf - 1)) ** 2
        self.blocks = nn.ModuleList([Interaction(hidden, filters, n_rbf, cutoff) for _ in range(interactions)])
        self.head = nn.Sequential(nn.Linear(hidden, hidden // 2), ShiftedSoftplus(), nn.Linear(hidden // 2, 1))

    def forward(self, data):
        pos = data.pos.requires_grad_(True)
        i, j = data.edge_index
        edge_batch = data.batch[i]
        shift = torch.bmm(data.cell_offsets.float().unsqueeze(1), data.cell[edge_batch]).squeeze(1)
        d = (pos[j] - pos[i] + shift).norm(dim=-1)
        rbf = torch.exp(-self.gamma * (d.unsqueeze(-1) - self.centers) ** 2)
        h = self.embedding(data.atomic_numbers)
        for block in self.blocks:
            h = block(h, data.edge_index, d, rbf)
        e_atom = self.head(h).squeeze(-1)
        energy = e_atom.new_zeros(data.num_graphs).index_add_(0, data.batch, e_atom)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def compute_loss(energy, forces, data, cfg):
    e_target = (data.y - cfg["energy_mean"]) / cfg["energy_std"]
    e_pred = (energy - cfg["energy_mean"]) / cfg["energy_std"]
    e_loss = (e_pred - e_target).abs().mean()
    free = data.fixed == 0
    f_loss = (forces[free] - data.force[free]).norm(dim=-1).mean() / cfg["force_std"]
    return cfg["energy_coef"] * e_loss + cfg["force_coef"] * f_loss, e_loss.detach(), f_loss.detach()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(4, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        with torch.enable_grad():
            energy, forces = model(data)
        tot[0] += (energy - data.y).abs().sum()
        tot[1] += data.num_graphs
        tot[2] += (forces - data.force).abs().sum()
        tot[3] += data.force.numel()
    dist.all_reduce(tot)
    return (tot[0] / tot[1]).item(), (tot[2] / tot[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", default="/shared/runs/s2ef_schnet")
    cli = ap.parse_args()
    with open(cli.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    train_set = LmdbDataset(cfg["train_src"])
    val_set = LmdbDataset(cfg["val_src"])
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg.get("num_workers", 8), pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=cfg["eval_batch_size"],
                            num_workers=cfg.get("num_workers", 8))

    model = SchNetPBC(**cfg["model"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    total_steps = cfg["epochs"] * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total_steps, pct_start=0.05)

    if rank == 0:
        os.makedirs(cli.run_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.2f}M parameters, {len(train_set)} train frames, world {world}", flush=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            energy, forces = model(data)
            loss, e_loss, f_loss = compute_loss(energy, forces, data, cfg)
            if not torch.isfinite(loss):
                print(f"[rank {rank}] non-finite loss at step {step}, skipping batch", flush=True)
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("clip_grad_norm", 50.0))
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % cfg.get("print_every", 100) == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} e {e_loss.item():.4f} "
                      f"f {f_loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / cfg.get('print_every', 100):.3f}s/it", flush=True)
                t0 = time.time()

        e_mae, f_mae = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val energy MAE {e_mae:.4f} eV force MAE {f_mae:.4f} eV/A", flush=True)
            torch.save({"state_dict": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "epoch": epoch, "step": step, "config": cfg},
                       os.path.join(cli.run_dir, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
