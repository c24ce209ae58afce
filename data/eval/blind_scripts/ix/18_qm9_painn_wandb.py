"""Deep PaiNN on QM9 U0 with activation checkpointing, W&B logging and a test-set
prediction dump collected from all ranks.

    torchrun --standalone --nproc_per_node=8 18_qm9_painn_wandb.py --root /data/QM9 --layers 8 --grad_ckpt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import radius_graph
from torch_scatter import scatter

U0 = 7


class PaiNNBlock(nn.Module):
    def __init__(self, F_, n_rbf):
        super().__init__()
        self.F = F_
        self.phi = nn.Sequential(nn.Linear(F_, F_), nn.SiLU(), nn.Linear(F_, 3 * F_))
        self.W = nn.Linear(n_rbf, 3 * F_)
        self.U = nn.Linear(F_, F_, bias=False)
        self.V = nn.Linear(F_, F_, bias=False)
        self.a = nn.Sequential(nn.Linear(2 * F_, F_), nn.SiLU(), nn.Linear(F_, 3 * F_))

    def forward(self, s, v, edge_index, rbf, unit):
        j, i = edge_index
        x = self.phi(s)[j] * self.W(rbf)
        ds, dvv, dvs = x.split(self.F, -1)
        s = s + scatter(ds, i, dim=0, dim_size=s.size(0))
        v = v + scatter(dvv.unsqueeze(1) * v[j] + dvs.unsqueeze(1) * unit.unsqueeze(-1), i, dim=0, dim_size=v.size(0))
        Uv, Vv = self.U(v), self.V(v)
        avv, asv, ass = self.a(torch.cat([s, torch.sqrt(Vv.pow(2).sum(1) + 1e-8)], -1)).split(self.F, -1)
        return s + asv * (Uv * Vv).sum(1) + ass, v + avv.unsqueeze(1) * Uv


class PaiNN(nn.Module):
    def __init__(self, F_=128, layers=8, n_rbf=20, cutoff=5.0, grad_ckpt=False, atom_mean=0.0):
        super().__init__()
        self.F, self.cutoff, self.n_rbf, self.grad_ckpt = F_, cutoff, n_rbf, grad_ckpt
        self.emb = nn.Embedding(10, F_)
        self.blocks = nn.ModuleList(PaiNNBlock(F_, n_rbf) for _ in range(layers))
        self.out = nn.Sequential(nn.Linear(F_, F_), nn.SiLU(), nn.Linear(F_, 1))
        self.register_buffer("atom_mean", torch.tensor(float(atom_mean)))

    def forward(self, z, pos, batch):
        edge_index = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        vec = pos[edge_index[0]] - pos[edge_index[1]]
        d = vec.norm(dim=-1, keepdim=True)
        n = torch.arange(1, self.n_rbf + 1, device=d.device, dtype=d.dtype)
        rbf = torch.sin(n * math.pi * d / self.cutoff) / d * (0.5 * (torch.cos(math.pi * d / self.cutoff) + 1))
        unit = vec / d
        s = self.emb(z)
        v = s.new_zeros(s.size(0), 3, self.F)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                # non-reentrant checkpointing works with DDP's autograd hooks
                s, v = checkpoint(blk, s, v, edge_index, rbf, unit, use_reentrant=False)
            else:
                s, v = blk(s, v, edge_index, rbf, unit)
        return scatter(self.out(s).squeeze(-1) + self.atom_mean, batch, dim=0, reduce="sum")


@torch.no_grad()
def evaluate(model, loader, device, collect=False):
    model.eval()
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    rows = []
    for data in loader:
        data = data.to(device)
        pred = model(data.z, data.pos, data.batch)
        acc[0] += (pred - data.y[:, U0]).abs().sum()
        acc[1] += data.num_graphs
        if collect:
            rows.extend(zip(data.idx.tolist(), pred.tolist(), data.y[:, U0].tolist()))
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item(), rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/QM9")
    ap.add_argument("--out", default="runs/painn_u0")
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--wandb_project", default="qm9-painn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        run = wandb.init(project=args.wandb_project, config={**vars(args), "world_size": world}, dir=args.out)
        QM9(args.root)  # download and process before the other ranks touch the folder
    dist.barrier()
    ds = QM9(args.root)

    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    train_ids, val_ids, test_ids = perm[:110000], perm[110000:120000], perm[120000:]
    y = ds.y[train_ids, U0]
    natoms = torch.tensor([ds[i].num_nodes for i in train_ids[:5000]], dtype=torch.float)
    atom_mean = (y[:5000] / natoms).mean().item()

    train_set = Subset(ds, train_ids)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(Subset(ds, val_ids[rank::world]), batch_size=128)
    test_loader = DataLoader(Subset(ds, test_ids[rank::world]), batch_size=128)

    net = PaiNN(layers=args.layers, grad_ckpt=args.grad_ckpt, atom_mean=atom_mean).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=25, min_lr=1e-6)

    best, best_path = float("inf"), os.path.join(args.out, "best.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tr = torch.zeros(2, device=device)
        for step, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            pred = model(data.z, data.pos, data.batch)
            loss = F.mse_loss(pred, data.y[:, U0])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            tr += torch.stack([loss.detach() * data.num_graphs, torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(tr)

        val_mae, _ = evaluate(model, val_loader, device)
        plateau.step(val_mae)
        if rank == 0:
            run.log({"epoch": epoch, "train/rmse": (tr[0] / tr[1]).sqrt().item(), "val/mae_meV": 1000 * val_mae,
                     "lr": opt.param_groups[0]["lr"], "epoch_time_s": time.time() - t0})
            if val_mae < best:
                best = val_mae
                torch.save({"model": net.state_dict(), "epoch": epoch, "val_mae": val_mae}, best_path)
        dist.barrier()

    net.load_state_dict(torch.load(best_path, map_location=device)["model"])
    test_mae, rows = evaluate(net, test_loader, device, collect=True)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)  # shards have different lengths, so gather Python objects
    if rank == 0:
        all_rows = sorted(r for part in gathered for r in part)
        with open(os.path.join(args.out, "test_predictions.csv"), "w") as f:
            f.write("idx,pred_eV,true_eV\n")
            f.writelines(f"{i},{p:.6f},{t:.6f}\n" for i, p, t in all_rows)
        run.summary["test/mae_meV"] = 1000 * test_mae
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
