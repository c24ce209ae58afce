"""PaiNN energy + force training on rMD17 with DDP.

Forces are the negative gradient of the predicted energy with respect to the
atomic positions, so the force loss needs a second backward pass through the
network (create_graph=True during training).

    torchrun --standalone --nproc_per_node=4 02_painn_md17_forces.py --molecule "revised aspirin"
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import MD17
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/md17")
    ap.add_argument("--molecule", default="revised aspirin")
    ap.add_argument("--out", default="runs/painn_md17")
    ap.add_argument("--n-train", type=int, default=950)
    ap.add_argument("--n-val", type=int, default=50)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--rbf", type=int, default=20)
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--batch-size", type=int, default=4, help="molecules per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--energy-weight", type=float, default=0.05)
    ap.add_argument("--force-weight", type=float, default=0.95)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def cosine_cutoff(d, rc):
    return 0.5 * (torch.cos(math.pi * d / rc) + 1.0) * (d < rc).to(d.dtype)


class SinusRBF(nn.Module):
    def __init__(self, n, rc):
        super().__init__()
        self.rc = rc
        self.register_buffer("freqs", torch.arange(1, n + 1) * math.pi / rc)

    def forward(self, d):
        d = d.unsqueeze(-1)
        return torch.sin(self.freqs * d) / d


class Message(nn.Module):
    def __init__(self, f, n_rbf):
        super().__init__()
        self.f = f
        self.phi = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 3 * f))
        self.w = nn.Linear(n_rbf, 3 * f)

    def forward(self, s, v, edge_index, rbf, fcut, unit):
        i, j = edge_index
        x = self.phi(s)[j] * self.w(rbf) * fcut.unsqueeze(-1)
        ds, dv_v, dv_s = torch.split(x, self.f, dim=-1)
        dv = v[j] * dv_v.unsqueeze(1) + dv_s.unsqueeze(1) * unit.unsqueeze(-1)
        s = s + torch.zeros_like(s).index_add_(0, i, ds)
        v = v + torch.zeros_like(v).index_add_(0, i, dv)
        return s, v


class Update(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f
        self.uv = nn.Linear(f, 2 * f, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * f, f), nn.SiLU(), nn.Linear(f, 3 * f))

    def forward(self, s, v):
        u_v, v_v = torch.split(self.uv(v), self.f, dim=-1)
        v_norm = torch.sqrt((v_v ** 2).sum(dim=1) + 1e-8)
        a = self.mlp(torch.cat([s, v_norm], dim=-1))
        a_vv, a_sv, a_ss = torch.split(a, self.f, dim=-1)
        s = s + (u_v * v_v).sum(dim=1) * a_sv + a_ss
        v = v + a_vv.unsqueeze(1) * u_v
        return s, v


class PaiNN(nn.Module):
    def __init__(self, features, layers, n_rbf, cutoff, energy_shift, energy_scale):
        super().__init__()
        self.cutoff = cutoff
        self.embed = nn.Embedding(100, features)
        self.rbf = SinusRBF(n_rbf, cutoff)
        self.messages = nn.ModuleList([Message(features, n_rbf) for _ in range(layers)])
        self.updates = nn.ModuleList([Update(features) for _ in range(layers)])
        self.readout = nn.Sequential(nn.Linear(features, features // 2), nn.SiLU(), nn.Linear(features // 2, 1))
        # dataset statistics, fixed for the whole run
        self.register_buffer("energy_shift", torch.tensor(float(energy_shift)))
        self.register_buffer("energy_scale", torch.tensor(float(energy_scale)))

    def forward(self, z, pos, batch, num_graphs):
        pos.requires_grad_(True)
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        i, j = edge_index
        vec = pos[j] - pos[i]
        d = vec.norm(dim=-1)
        unit = vec / d.unsqueeze(-1)
        rbf = self.rbf(d)
        fcut = cosine_cutoff(d, self.cutoff)

        s = self.embed(z)
        v = s.new_zeros(s.size(0), 3, s.size(1))
        for msg, upd in zip(self.messages, self.updates):
            s, v = msg(s, v, edge_index, rbf, fcut, unit)
            s, v = upd(s, v)

        e_atom = self.readout(s).squeeze(-1) * self.energy_scale
        energy = e_atom.new_zeros(num_graphs).index_add_(0, batch, e_atom)
        energy = energy + self.energy_shift
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def evaluate(net, loader, device):
    """Sum of absolute errors over this rank's shard; caller reduces."""
    net.eval()
    stats = torch.zeros(4, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        with torch.enable_grad():
            e, f = net(data.z, data.pos, data.batch, data.num_graphs)
        stats[0] += (e.detach() - data.energy.view(-1)).abs().sum()
        stats[1] += (f.detach() - data.force).abs().sum()
        stats[2] += data.num_graphs
        stats[3] += data.force.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[3]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    if rank == 0:
        MD17(args.root, name=args.molecule)
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    dataset = MD17(args.root, name=args.molecule)

    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    train_set = dataset[perm[:args.n_train]]
    val_set = dataset[perm[args.n_train:args.n_train + args.n_val]]
    test_set = dataset[perm[args.n_train + args.n_val:]]

    # Statistics from the (identical on every rank) training split.
    e_train = torch.cat([d.energy for d in train_set])
    f_train = torch.cat([d.force for d in train_set])
    shift, scale = e_train.mean().item(), f_train.pow(2).mean().sqrt().item()

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    # Strided shards: every test molecule is seen exactly once across ranks.
    val_loader = DataLoader(val_set[torch.arange(rank, len(val_set), world)], batch_size=32)
    test_loader = DataLoader(test_set[torch.arange(rank, len(test_set), world)], batch_size=32)

    model = PaiNN(args.features, args.layers, args.rbf, args.cutoff, shift, scale).to(device)
    # Only constant statistics live in buffers, nothing to keep in sync.
    model = DDP(model, device_ids=[local_rank], broadcast_buffers=False)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=5, min_lr=1e-6)

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for data in train_loader:
            data = data.to(device)
            e, f = model(data.z, data.pos, data.batch, data.num_graphs)
            loss_e = ((e - data.energy.view(-1)) / scale).pow(2).mean()
            loss_f = ((f - data.force) / scale).pow(2).mean()
            loss = args.energy_weight * loss_e + args.force_weight * loss_f
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()

        if (epoch + 1) % args.eval_every:
            continue
        e_mae, f_mae = evaluate(model.module, val_loader, device)
        sched.step(0.05 * e_mae + 0.95 * f_mae)
        if rank == 0:
            print(f"[{epoch + 1}] val E {e_mae:.3f} F {f_mae:.3f} kcal/mol(/A) "
                  f"lr {opt.param_groups[0]['lr']:.1e} {time.time() - tic:.1f}s/ep", flush=True)
            if f_mae < best:
                best = f_mae
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    state = torch.load(os.path.join(args.out, "best.pt"), map_location=device)
    model.module.load_state_dict(state["model"])
    e_mae, f_mae = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"test energy MAE {e_mae:.3f} kcal/mol  force MAE {f_mae:.3f} kcal/mol/A")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
