"""Train a SchNet-style interatomic potential on MD17-like trajectories.

Energy + force matching, forces obtained as -dE/dx via autograd.
Launch with torchrun, one process per GPU.
"""
import argparse
import json
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("schnet")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="npz with R, z, E, F")
    p.add_argument("--out", default="runs/schnet_md17")
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--n-interactions", type=int, default=6)
    p.add_argument("--n-rbf", type=int, default=50)
    p.add_argument("--force-weight", type=float, default=100.0)
    p.add_argument("--n-train", type=int, default=950)
    p.add_argument("--n-val", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default=None)
    return p.parse_args()


class MD17(Dataset):
    def __init__(self, path):
        d = np.load(path)
        self.R = torch.from_numpy(d["R"]).float()
        self.z = torch.from_numpy(d["z"]).long()
        self.E = torch.from_numpy(d["E"]).float().reshape(-1)
        self.F = torch.from_numpy(d["F"]).float()

    def __len__(self):
        return self.R.shape[0]

    def __getitem__(self, i):
        return {"pos": self.R[i], "z": self.z, "energy": self.E[i], "forces": self.F[i]}


def collate(samples, cutoff):
    pos, z, energy, forces, batch, edges = [], [], [], [], [], []
    offset = 0
    for gi, s in enumerate(samples):
        n = s["pos"].shape[0]
        d = torch.cdist(s["pos"], s["pos"])
        src, dst = torch.nonzero((d < cutoff) & (d > 0), as_tuple=True)
        edges.append(torch.stack([src, dst]) + offset)
        pos.append(s["pos"])
        z.append(s["z"])
        forces.append(s["forces"])
        energy.append(s["energy"])
        batch.append(torch.full((n,), gi, dtype=torch.long))
        offset += n
    return {
        "pos": torch.cat(pos),
        "z": torch.cat(z),
        "edge_index": torch.cat(edges, dim=1),
        "batch": torch.cat(batch),
        "energy": torch.stack(energy),
        "forces": torch.cat(forces),
        "n_graphs": len(samples),
    }


class GaussianRBF(nn.Module):
    def __init__(self, n_rbf, cutoff):
        super().__init__()
        self.register_buffer("centers", torch.linspace(0.0, cutoff, n_rbf))
        self.gamma = 0.5 / (cutoff / n_rbf) ** 2

    def forward(self, d):
        return torch.exp(-self.gamma * (d.unsqueeze(-1) - self.centers) ** 2)


def cosine_cutoff(d, cutoff):
    return 0.5 * (torch.cos(d * math.pi / cutoff) + 1.0) * (d < cutoff).float()


class Interaction(nn.Module):
    def __init__(self, hidden, n_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.filter = nn.Sequential(nn.Linear(n_rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.in2f = nn.Linear(hidden, hidden, bias=False)
        self.f2out = nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, h, rbf, d, edge_index):
        src, dst = edge_index
        W = self.filter(rbf) * cosine_cutoff(d, self.cutoff).unsqueeze(-1)
        msg = self.in2f(h)[src] * W
        agg = torch.zeros_like(h).index_add_(0, dst, msg)
        return h + self.f2out(agg)


class SchNet(nn.Module):
    def __init__(self, hidden, n_interactions, n_rbf, cutoff, max_z=100):
        super().__init__()
        self.embed = nn.Embedding(max_z, hidden)
        self.rbf = GaussianRBF(n_rbf, cutoff)
        self.blocks = nn.ModuleList([Interaction(hidden, n_rbf, cutoff) for _ in range(n_interactions)])
        self.head = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.SiLU(), nn.Linear(hidden // 2, 1))
        self.register_buffer("e_mean", torch.zeros(()))
        self.register_buffer("e_std", torch.ones(()))

    def forward(self, z, pos, edge_index, batch, n_graphs):
        src, dst = edge_index
        d = (pos[src] - pos[dst]).norm(dim=-1)
        rbf = self.rbf(d)
        h = self.embed(z)
        for blk in self.blocks:
            h = blk(h, rbf, d, edge_index)
        e_atom = self.head(h).squeeze(-1) * self.e_std + self.e_mean
        return torch.zeros(n_graphs, device=pos.device).index_add_(0, batch, e_atom)


def energy_and_forces(model, b):
    pos = b["pos"].requires_grad_(True)
    energy = model(b["z"], pos, b["edge_index"], b["batch"], b["n_graphs"])
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=model.training)[0]
    return energy, forces


def to_device(b, device):
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in b.items()}


def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(4, device=device)  # e_abs_sum, n_graphs, f_abs_sum, n_force_components
    for b in loader:
        b = to_device(b, device)
        with torch.enable_grad():
            e, f = energy_and_forces(model, b)
        stats[0] += (e.detach() - b["energy"]).abs().sum()
        stats[1] += b["n_graphs"]
        stats[2] += (f.detach() - b["forces"]).abs().sum()
        stats[3] += b["forces"].numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(args.seed)

    ds = MD17(args.data)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(ds), generator=g).tolist()
    train_ds = Subset(ds, perm[: args.n_train])
    val_ds = Subset(ds, perm[args.n_train: args.n_train + args.n_val])
    # validation: strided shard, no padding duplicates
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))

    coll = lambda s: collate(s, args.cutoff)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=coll, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, collate_fn=coll, num_workers=2)

    model = SchNet(args.hidden, args.n_interactions, args.n_rbf, args.cutoff)
    e_per_atom = ds.E[perm[: args.n_train]] / ds.z.numel()
    model.e_mean.fill_(float(e_per_atom.mean()))
    model.e_std.fill_(float(e_per_atom.std()))
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=10, min_lr=1e-6)

    start_epoch, best = 0, float("inf")
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for b in train_loader:
            b = to_device(b, device)
            e, f = energy_and_forces(ddp, b)
            n_atoms = b["pos"].shape[0] / b["n_graphs"]
            loss_e = F.mse_loss(e / n_atoms, b["energy"] / n_atoms)
            loss_f = F.mse_loss(f, b["forces"])
            loss = loss_e + args.force_weight * loss_f
            if not torch.isfinite(loss):
                log.warning("non-finite loss at step %d (E %.3g F %.3g), skipping batch",
                            step, loss_e.item(), loss_f.item())
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
            opt.step()
            run[0] += loss.detach()
            run[1] += 1
            step += 1

        dist.all_reduce(run)
        e_mae, f_mae = evaluate(model, val_loader, device)
        sched.step(f_mae)
        if rank == 0:
            log.info("epoch %d loss %.4f | val E-MAE %.4f F-MAE %.4f | lr %.2e | %.1fs",
                     epoch, (run[0] / run[1].clamp(min=1)).item(), e_mae, f_mae,
                     opt.param_groups[0]["lr"], time.time() - t0)
            ck = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "best": min(best, f_mae), "args": vars(args)}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if f_mae < best:
                torch.save(ck, os.path.join(args.out, "best.pt"))
                with open(os.path.join(args.out, "best.json"), "w") as fh:
                    json.dump({"epoch": epoch, "e_mae": e_mae, "f_mae": f_mae}, fh)
        best = min(best, f_mae)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
