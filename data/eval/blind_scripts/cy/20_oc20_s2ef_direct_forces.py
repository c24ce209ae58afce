"""Direct-force S2EF model for OC20 (energy head + per-edge force head, no autograd).

    srun --ntasks-per-node=1 torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
        20_oc20_s2ef_direct_forces.py --train /data/oc20/s2ef/2M/train --val /data/oc20/s2ef/all/val_id
"""
import argparse
import bisect
import math
import os
import pickle
import time
from pathlib import Path

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.loader import DataLoader
from torch_scatter import scatter


class S2EFDataset(Dataset):
    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*.lmdb"))
        self.keys, self.envs = [], None
        for fp in self.files:
            env = lmdb.open(str(fp), subdir=False, readonly=True, lock=False, readahead=False, meminit=False)
            self.keys.append(env.stat()["entries"] - 1)  # minus the "length" entry
            env.close()
        self.cum = [0]
        for n in self.keys:
            self.cum.append(self.cum[-1] + n)

    def __len__(self):
        return self.cum[-1]

    def __getitem__(self, idx):
        if self.envs is None:
            self.envs = [lmdb.open(str(fp), subdir=False, readonly=True, lock=False, readahead=False,
                                   meminit=False, max_readers=1) for fp in self.files]
        k = bisect.bisect_right(self.cum, idx) - 1
        with self.envs[k].begin() as txn:
            data = pickle.loads(txn.get(str(idx - self.cum[k]).encode()))
        data.atomic_numbers = data.atomic_numbers.long()
        data.tags = data.tags.long()
        return data


class RadialBasis(nn.Module):
    def __init__(self, n, cutoff, p=5):
        super().__init__()
        self.cutoff, self.p = cutoff, p
        self.register_buffer("freq", torch.arange(1, n + 1).float() * math.pi)

    def forward(self, d):
        x = d / self.cutoff
        p = self.p
        env = 1 - (p + 1) * (p + 2) / 2 * x ** p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
        return (env * (x < 1)).unsqueeze(-1) * torch.sin(self.freq * x.unsqueeze(-1)) / x.unsqueeze(-1)


class Block(nn.Module):
    def __init__(self, dim, n_rbf):
        super().__init__()
        self.msg = nn.Sequential(nn.Linear(2 * dim + n_rbf, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.upd = nn.Sequential(nn.Linear(2 * dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, h, ei, rbf):
        src, dst = ei
        m = self.msg(torch.cat([h[src], h[dst], rbf], dim=-1))
        agg = scatter(m, dst, dim=0, dim_size=h.size(0), reduce="mean")
        return self.norm(h + self.upd(torch.cat([h, agg], dim=-1))), m


class DirectS2EF(nn.Module):
    def __init__(self, dim=256, layers=5, n_rbf=128, cutoff=6.0):
        super().__init__()
        self.cutoff = cutoff
        self.atom_emb = nn.Embedding(90, dim)
        self.tag_emb = nn.Embedding(3, dim)
        self.rbf = RadialBasis(n_rbf, cutoff)
        self.blocks = nn.ModuleList([Block(dim, n_rbf) for _ in range(layers)])
        self.energy_head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))
        self.force_head = nn.Sequential(nn.Linear(dim * layers, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, data):
        src, dst = data.edge_index
        off = torch.bmm(data.cell_offsets.float().unsqueeze(1), data.cell[data.batch[src]]).squeeze(1)
        vec = data.pos[src] - data.pos[dst] + off
        d = vec.norm(dim=-1).clamp(min=1e-6)
        rbf = self.rbf(d)
        h = self.atom_emb(data.atomic_numbers) + self.tag_emb(data.tags)
        msgs = []
        for blk in self.blocks:
            h, m = blk(h, data.edge_index, rbf)
            msgs.append(m)
        energy = scatter(self.energy_head(h).squeeze(-1), data.batch, dim=0, dim_size=data.num_graphs)
        w = self.force_head(torch.cat(msgs, dim=-1))
        forces = scatter(w * vec / d.unsqueeze(-1), dst, dim=0, dim_size=h.size(0))
        return energy, forces


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    m = torch.zeros(5, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        e, f = net(data)
        free = data.fixed == 0
        m[0] += (e - data.y).abs().sum()
        m[1] += data.num_graphs
        m[2] += (f[free] - data.force[free]).abs().sum()
        m[3] += 3 * free.sum()
        m[4] += torch.nn.functional.cosine_similarity(f[free], data.force[free], dim=-1).sum()
    dist.all_reduce(m)
    return {"energy_mae": (m[0] / m[1]).item(), "forces_mae": (m[2] / m[3]).item(),
            "forces_cos": (m[4] / (m[3] / 3)).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--val-max", type=int, default=30000)
    ap.add_argument("--ckpt-dir", default="/lustre/project/oc20/direct_s2ef")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--energy-coef", type=float, default=1.0)
    ap.add_argument("--force-coef", type=float, default=100.0)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    train_ds = S2EFDataset(args.train)
    val_ds = S2EFDataset(args.val)
    val_idx = list(range(min(args.val_max, len(val_ds))))[rank::world]
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, prefetch_factor=4)
    val_loader = DataLoader(Subset(val_ds, val_idx), batch_size=16, num_workers=args.workers)

    model = DDP(DirectS2EF().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.001)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 5000) * max(0.02, 0.5 * (1 + math.cos(math.pi * s / total))))

    ckpt = Path(args.ckpt_dir) / "checkpoint.pt"
    start_epoch = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1
    if rank == 0:
        Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for it, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            e, f = model(data)
            natoms = data.natoms.float()
            e_loss = ((e - data.y) / natoms).abs().mean()
            free = data.fixed == 0
            f_loss = (f[free] - data.force[free]).norm(dim=-1).mean()
            loss = args.energy_coef * e_loss + args.force_coef * f_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"[ep {epoch} it {it}/{len(train_loader)}] e {e_loss.item():.4f} f {f_loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / (it + 1):.3f}s/it", flush=True)

        metrics = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} val_id: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "metrics": metrics}, str(ckpt) + ".tmp")
            os.replace(str(ckpt) + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
