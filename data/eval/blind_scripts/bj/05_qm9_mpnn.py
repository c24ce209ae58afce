"""Gilmer-style MPNN (NNConv + Set2Set) on QM9, one target at a time, DDP.

    torchrun --standalone --nproc_per_node=8 05_qm9_mpnn.py --target 4 --epochs 300
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import random_split
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.nn import NNConv, Set2Set
from torch_geometric.utils import remove_self_loops

TARGET_NAMES = ["mu", "alpha", "homo", "lumo", "gap", "r2", "zpve", "U0", "U", "H", "G", "Cv"]


class SelectTarget(T.BaseTransform):
    def __init__(self, target):
        self.target = target

    def forward(self, data):
        data.y = data.y[:, self.target]
        return data


class Complete(T.BaseTransform):
    """Fully connected graph with the bond features on existing edges."""

    def forward(self, data):
        device = data.edge_index.device
        row = torch.arange(data.num_nodes, dtype=torch.long, device=device)
        col = torch.arange(data.num_nodes, dtype=torch.long, device=device)
        row = row.view(-1, 1).repeat(1, data.num_nodes).view(-1)
        col = col.repeat(data.num_nodes)
        edge_index = torch.stack([row, col], dim=0)
        edge_attr = None
        if data.edge_attr is not None:
            idx = data.edge_index[0] * data.num_nodes + data.edge_index[1]
            size = list(data.edge_attr.size())
            size[0] = data.num_nodes * data.num_nodes
            edge_attr = data.edge_attr.new_zeros(size)
            edge_attr[idx] = data.edge_attr
        edge_index, edge_attr = remove_self_loops(edge_index, edge_attr)
        data.edge_attr = edge_attr
        data.edge_index = edge_index
        return data


class MPNN(nn.Module):
    def __init__(self, in_dim, edge_dim, dim=64, steps=3):
        super().__init__()
        self.steps = steps
        self.lin0 = nn.Linear(in_dim, dim)
        edge_net = nn.Sequential(nn.Linear(edge_dim, 128), nn.ReLU(), nn.Linear(128, dim * dim))
        self.conv = NNConv(dim, dim, edge_net, aggr="mean")
        self.gru = nn.GRU(dim, dim)
        self.set2set = Set2Set(dim, processing_steps=3)
        self.lin1 = nn.Linear(2 * dim, dim)
        self.lin2 = nn.Linear(dim, 1)

    def forward(self, data):
        out = F.relu(self.lin0(data.x))
        h = out.unsqueeze(0)
        for _ in range(self.steps):
            m = F.relu(self.conv(out, data.edge_index, data.edge_attr))
            out, h = self.gru(m.unsqueeze(0), h)
            out = out.squeeze(0)
        out = self.set2set(out, data.batch)
        return self.lin2(F.relu(self.lin1(out))).view(-1)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/scratch/proj/molml/QM9")
    p.add_argument("--target", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--n-val", type=int, default=10000)
    p.add_argument("--n-test", type=int, default=10000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save-dir", default="/scratch/proj/molml/runs/qm9_mpnn")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, std, device):
    model.eval()
    err = torch.zeros(2, device=device)
    for data in loader:
        data = data.to(device)
        err[0] += ((model(data) * std - data.y * std).abs()).sum()
        err[1] += data.num_graphs
    dist.all_reduce(err)
    return (err[0] / err[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    transform = T.Compose([SelectTarget(args.target), Complete(), T.Distance(norm=False)])
    if rank == 0:
        QM9(args.root)  # triggers download + processing on the first run
    dist.barrier()
    dataset = QM9(args.root, transform=transform)

    n_train = len(dataset) - args.n_val - args.n_test
    train_set, val_set, test_set = random_split(dataset, [n_train, args.n_val, args.n_test])

    # standardise the target with training statistics
    y_all = dataset._data.y[:, args.target]
    y_train = y_all[torch.as_tensor(train_set.indices)]
    mean, std = y_train.mean().item(), y_train.std().item()
    dataset._data.y[:, args.target] = (y_all - mean) / std

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler, num_workers=2)
    test_loader = DataLoader(test_set, batch_size=128, sampler=test_sampler, num_workers=2)

    model = MPNN(dataset.num_features, 5, dim=args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.7,
                                                           patience=5, min_lr=1e-5)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_val, test_mae = None, None
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device)
            optimizer.zero_grad()
            loss = F.mse_loss(model(data), data.y)
            loss.backward()
            optimizer.step()
            loss_acc += torch.stack([loss.detach() * data.num_graphs,
                                     torch.tensor(float(data.num_graphs), device=device)])
        dist.all_reduce(loss_acc)

        val_mae = evaluate(model.module, val_loader, std, device)
        scheduler.step(val_mae)
        if best_val is None or val_mae <= best_val:
            test_mae = evaluate(model.module, test_loader, std, device)
            best_val = val_mae
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "mean": mean, "std": std,
                            "target": args.target, "epoch": epoch},
                           os.path.join(args.save_dir, f"best_{TARGET_NAMES[args.target]}.pt"))
        if rank == 0:
            print(f"epoch {epoch:03d} lr {optimizer.param_groups[0]['lr']:.6f} "
                  f"loss {(loss_acc[0] / loss_acc[1]).item():.5f} val MAE {val_mae:.5f} "
                  f"test MAE {test_mae:.5f} ({time.time() - t0:.0f}s)", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
