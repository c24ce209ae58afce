"""PaiNN force field on revised MD17, DDP with resumable checkpoints.

    torchrun --nproc_per_node=4 10_painn_md17.py --molecule revised ethanol --out runs/painn_ethanol
    # after preemption:
    torchrun --nproc_per_node=4 10_painn_md17.py --molecule revised ethanol --out runs/painn_ethanol \
        --resume runs/painn_ethanol/last.pt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import MD17
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_geometric.utils import scatter


class RBF(nn.Module):
    def __init__(self, n, cutoff):
        super().__init__()
        self.register_buffer("freq", torch.arange(1, n + 1) * math.pi / cutoff)
        self.cutoff = cutoff

    def forward(self, d):
        d = d.unsqueeze(-1)
        rbf = torch.sin(self.freq * d) / d
        fc = 0.5 * (torch.cos(math.pi * d / self.cutoff) + 1.0) * (d < self.cutoff)
        return rbf * fc


class PaiNNLayer(nn.Module):
    def __init__(self, f, n_rbf):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(f, f), nn.SiLU(), nn.Linear(f, 3 * f))
        self.w = nn.Linear(n_rbf, 3 * f)
        self.U = nn.Linear(f, f, bias=False)
        self.V = nn.Linear(f, f, bias=False)
        self.upd = nn.Sequential(nn.Linear(2 * f, f), nn.SiLU(), nn.Linear(f, 3 * f))
        self.f = f

    def forward(self, s, v, edge_index, rbf, unit):
        src, dst = edge_index
        x = self.phi(s)[src] * self.w(rbf)
        x_vv, x_ss, x_vs = x.split(self.f, dim=-1)
        dv = v[src] * x_vv.unsqueeze(1) + x_vs.unsqueeze(1) * unit.unsqueeze(-1)
        s = s + scatter(x_ss, dst, dim=0, dim_size=s.size(0))
        v = v + scatter(dv, dst, dim=0, dim_size=s.size(0))
        Uv, Vv = self.U(v), self.V(v)
        a = self.upd(torch.cat([s, torch.sqrt((Vv ** 2).sum(1) + 1e-8)], dim=-1))
        a_vv, a_sv, a_ss = a.split(self.f, dim=-1)
        v = v + a_vv.unsqueeze(1) * Uv
        s = s + a_ss + a_sv * (Uv * Vv).sum(1)
        return s, v


class PaiNN(nn.Module):
    def __init__(self, f=128, layers=3, n_rbf=20, cutoff=5.0, max_z=10):
        super().__init__()
        self.emb = nn.Embedding(max_z, f)
        self.rbf = RBF(n_rbf, cutoff)
        self.layers = nn.ModuleList(PaiNNLayer(f, n_rbf) for _ in range(layers))
        self.out = nn.Sequential(nn.Linear(f, f // 2), nn.SiLU(), nn.Linear(f // 2, 1))
        self.cutoff = cutoff
        self.f = f

    def forward(self, z, pos, batch):
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        vec = pos[edge_index[1]] - pos[edge_index[0]]
        d = vec.norm(dim=-1)
        unit, rbf = vec / d.unsqueeze(-1), self.rbf(d)
        s = self.emb(z)
        v = s.new_zeros(s.size(0), 3, self.f)
        for layer in self.layers:
            s, v = layer(s, v, edge_index, rbf, unit)
        return scatter(self.out(s).squeeze(-1), batch, dim=0, reduce="sum")


def energy_forces(model, data):
    pos = data.pos.requires_grad_(True)
    e = model(data.z, pos, data.batch)
    f = -torch.autograd.grad(e.sum(), pos, create_graph=True)[0]
    return e, f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/md17")
    ap.add_argument("--molecule", default="revised ethanol")
    ap.add_argument("--n-train", type=int, default=950)
    ap.add_argument("--n-val", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rho-e", type=float, default=0.05)
    ap.add_argument("--out", default="runs/painn")
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        MD17(args.root, name=args.molecule)  # download + process once
    dist.barrier()
    ds = MD17(args.root, name=args.molecule)
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(42))
    train_ds = ds[perm[:args.n_train]]
    val_ds = ds[perm[args.n_train:args.n_train + args.n_val]]
    e_shift = torch.stack([d.energy for d in train_ds]).mean().item()

    sampler = DistributedSampler(train_ds, shuffle=True, seed=42, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    val_loader = DataLoader(val_ds, batch_size=16, sampler=val_sampler)

    model = PaiNN().to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=50)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))

    start_epoch, best = 0, float("inf")
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for data in loader:
            data = data.to(device)
            e, f = energy_forces(ddp, data)
            loss = (args.rho_e * F.mse_loss(e, data.energy.view(-1) - e_shift)
                    + (1 - args.rho_e) * F.mse_loss(f, data.force))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 10.0)
            opt.step()
            ema.update_parameters(model)

        # validation with the EMA weights (autograd needed for forces)
        ema.eval()
        err = torch.zeros(4, device=device)
        for data in val_loader:
            data = data.to(device)
            e, f = energy_forces(ema.module, data)
            err[0] += (e.detach() + e_shift - data.energy.view(-1)).abs().sum()
            err[1] += (f.detach() - data.force).abs().sum()
            err[2] += data.num_graphs
            err[3] += f.numel()
        dist.all_reduce(err)
        e_mae, f_mae = (err[0] / err[2]).item(), (err[1] / err[3]).item()
        score = args.rho_e * e_mae + (1 - args.rho_e) * f_mae
        sched.step(score)
        best = min(best, score)

        if rank == 0:
            if epoch % 10 == 0:
                print(f"epoch {epoch} E-MAE {e_mae * 43.36:.3f} meV F-MAE {f_mae * 43.36:.3f} meV/A "
                      f"lr {opt.param_groups[0]['lr']:.1e} {time.time() - t0:.1f}s", flush=True)
            state = {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": best, "e_shift": e_shift}
            torch.save(state, os.path.join(args.out, "last.pt.tmp"))
            os.replace(os.path.join(args.out, "last.pt.tmp"), os.path.join(args.out, "last.pt"))
            if score == best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        if opt.param_groups[0]["lr"] < 1e-6:
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
