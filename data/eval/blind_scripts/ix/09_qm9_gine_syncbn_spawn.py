"""GINE + distance features on QM9 (HOMO-LUMO gap), launched with mp.spawn.

The bond graph from QM9 is combined with a radius graph built on the GPU, and the
MLPs use BatchNorm (converted to SyncBatchNorm for multi-GPU training).

    python 09_qm9_gine_syncbn_spawn.py --gpus 4 --root ~/data/qm9
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINEConv, global_add_pool, global_mean_pool, radius_graph
from torch_geometric.utils import coalesce

GAP = 4  # QM9.y column, eV


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, o))


class GINEDist(nn.Module):
    def __init__(self, node_in=11, hidden=256, layers=5, n_rbf=32, cutoff=4.0):
        super().__init__()
        self.cutoff = cutoff
        self.register_buffer("centers", torch.linspace(0, cutoff, n_rbf))
        self.node_in = nn.Linear(node_in, hidden)
        # 4 bond types + 1 "no bond" channel, concatenated with the RBF expansion
        self.edge_in = nn.Linear(5 + n_rbf, hidden)
        self.convs = nn.ModuleList(GINEConv(mlp(hidden, 2 * hidden, hidden), edge_dim=hidden) for _ in range(layers))
        self.bns = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(layers))
        self.readout = mlp(2 * hidden, hidden, 1)

    def build_edges(self, data):
        # union of chemical bonds and spatial neighbours; radius-graph pairs set the 5th channel
        rg = radius_graph(data.pos, r=self.cutoff, batch=data.batch, max_num_neighbors=32)
        bond_attr = F.pad(data.edge_attr, (0, 1))
        rg_attr = torch.zeros(rg.size(1), 5, device=rg.device)
        rg_attr[:, 4] = 1.0
        edge_index = torch.cat([data.edge_index, rg], dim=1)
        edge_attr = torch.cat([bond_attr, rg_attr], dim=0)
        edge_index, edge_attr = coalesce(edge_index, edge_attr, num_nodes=data.num_nodes, reduce="max")
        d = (data.pos[edge_index[0]] - data.pos[edge_index[1]]).norm(dim=-1, keepdim=True)
        rbf = torch.exp(-4.0 * (d - self.centers) ** 2)
        return edge_index, torch.cat([edge_attr, rbf], dim=-1)

    def forward(self, data):
        edge_index, edge_attr = self.build_edges(data)
        e = self.edge_in(edge_attr)
        h = self.node_in(data.x)
        for conv, bn in zip(self.convs, self.bns):
            h = h + F.relu(bn(conv(h, edge_index, e)))
        g = torch.cat([global_add_pool(h, data.batch), global_mean_pool(h, data.batch)], dim=-1)
        return self.readout(g).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for data in loader:
        data = data.to(device)
        s[0] += (model(data) - data.y[:, GAP]).abs().sum()
        s[1] += data.num_graphs
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def worker(rank, world_size, port, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    dataset = QM9(args.root)  # already processed by the parent process
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_ids, val_ids, test_ids = perm[:110000], perm[110000:120000], perm[120000:]
    train_set = Subset(dataset, train_ids)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    # drop_last so BatchNorm never sees a 1-graph batch at the end of an epoch
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(dataset, val_ids[rank::world_size]), batch_size=256)
    test_loader = DataLoader(Subset(dataset, test_ids[rank::world_size]), batch_size=256)

    torch.manual_seed(args.seed)
    model = GINEDist(hidden=args.hidden, layers=args.layers)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))
    best, path = float("inf"), os.path.join(args.out, "gine_gap.pt")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            loss = F.smooth_l1_loss(model(data), data.y[:, GAP], beta=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        val = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} val gap MAE {val * 1000:.1f} meV ({time.time() - t0:.0f}s)", flush=True)
            if val < best:
                best = val
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)}, path)
        dist.barrier()

    state = torch.load(path, map_location=device)
    model.module.load_state_dict(state["model"])
    test = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"test gap MAE {test * 1000:.1f} meV (epoch {state['epoch']})")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--root", default=os.path.expanduser("~/data/qm9"))
    ap.add_argument("--out", default="checkpoints")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    QM9(args.root)  # download / process once, before any worker starts
    port = free_port()
    mp.spawn(worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
