"""E(n)-equivariant GNN (Satorras et al. 2021) on QM9, fully connected molecular graphs.

    torchrun --nproc_per_node=4 16_egnn_qm9_homo.py --property homo --exp_name egnn_homo
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import QM9
from torch_geometric.loader import DataLoader
from torch_geometric.utils import scatter

PROPS = {"mu": 0, "alpha": 1, "homo": 2, "lumo": 3, "gap": 4, "r2": 5, "zpve": 6,
         "U0": 7, "U": 8, "H": 9, "G": 10, "Cv": 11}

parser = argparse.ArgumentParser(description="EGNN QM9")
parser.add_argument("--exp_name", type=str, default="egnn_qm9")
parser.add_argument("--property", type=str, default="homo", choices=list(PROPS))
parser.add_argument("--data_root", type=str, default="data/QM9")
parser.add_argument("--outf", type=str, default="outputs")
parser.add_argument("--batch_size", type=int, default=96)
parser.add_argument("--epochs", type=int, default=1000)
parser.add_argument("--lr", type=float, default=5e-4)
parser.add_argument("--weight_decay", type=float, default=1e-16)
parser.add_argument("--nf", type=int, default=128)
parser.add_argument("--n_layers", type=int, default=7)
parser.add_argument("--attention", type=int, default=1)
parser.add_argument("--test_interval", type=int, default=1)
parser.add_argument("--num_workers", type=int, default=4)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--local_rank", type=int, default=0)


class E_GCL(nn.Module):
    def __init__(self, nf, edge_attr_nf=0, attention=True):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * nf + 1 + edge_attr_nf, nf), nn.SiLU(), nn.Linear(nf, nf), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * nf, nf), nn.SiLU(), nn.Linear(nf, nf))
        self.attention = attention
        if attention:
            self.att_mlp = nn.Sequential(nn.Linear(nf, 1), nn.Sigmoid())

    def forward(self, h, edge_index, radial, edge_mask):
        row, col = edge_index
        m = self.edge_mlp(torch.cat([h[row], h[col], radial], dim=-1))
        if self.attention:
            m = m * self.att_mlp(m)
        m = m * edge_mask
        agg = scatter(m, row, dim=0, dim_size=h.size(0), reduce="sum")
        return h + self.node_mlp(torch.cat([h, agg], dim=-1))


class EGNN(nn.Module):
    def __init__(self, in_nf, nf, n_layers, attention):
        super().__init__()
        self.embedding = nn.Linear(in_nf, nf)
        self.layers = nn.ModuleList([E_GCL(nf, attention=attention) for _ in range(n_layers)])
        self.node_dec = nn.Sequential(nn.Linear(nf, nf), nn.SiLU(), nn.Linear(nf, nf))
        self.graph_dec = nn.Sequential(nn.Linear(nf, nf), nn.SiLU(), nn.Linear(nf, 1))

    def forward(self, x, pos, batch, num_graphs):
        same = batch.unsqueeze(0) == batch.unsqueeze(1)
        same.fill_diagonal_(False)
        edge_index = same.nonzero().t()
        row, col = edge_index
        radial = (pos[row] - pos[col]).pow(2).sum(-1, keepdim=True)
        edge_mask = torch.ones_like(radial)
        h = self.embedding(x)
        for layer in self.layers:
            h = layer(h, edge_index, radial, edge_mask)
        h = self.node_dec(h)
        return self.graph_dec(scatter(h, batch, dim=0, dim_size=num_graphs, reduce="sum")).squeeze(-1)


def node_features(z, charge_power=2, max_charge=9):
    onehot = (z.unsqueeze(-1) == torch.tensor([1, 6, 7, 8, 9], device=z.device)).float()
    charges = (z.float() / max_charge).unsqueeze(-1)
    powers = torch.stack([charges ** p for p in range(charge_power + 1)], dim=-1)
    return (onehot.unsqueeze(-1) * powers).flatten(1)


@torch.no_grad()
def test(model, loader, target, meann, mad, device):
    model.eval()
    res = torch.zeros(2, dtype=torch.float64, device=device)
    for data in loader:
        data = data.to(device)
        pred = model(node_features(data.z), data.pos, data.batch, data.num_graphs)
        res[0] += (mad * pred + meann - data.y[:, target]).abs().sum()
        res[1] += data.num_graphs
    dist.all_reduce(res)
    return (res[0] / res[1]).item()


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)
    target = PROPS[args.property]

    if rank == 0:
        QM9(args.data_root)
        os.makedirs(os.path.join(args.outf, args.exp_name), exist_ok=True)
    dist.barrier()
    dataset = QM9(args.data_root)
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    train_set, val_set, test_set = dataset[perm[:100000]], dataset[perm[100000:117748]], dataset[perm[117748:]]

    y = torch.stack([d.y[0, target] for d in train_set])
    meann = y.mean().item()
    mad = (y - meann).abs().mean().item()

    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set[torch.arange(rank, len(val_set), world)], batch_size=args.batch_size)
    test_loader = DataLoader(test_set[torch.arange(rank, len(test_set), world)], batch_size=args.batch_size)

    model = EGNN(in_nf=15, nf=args.nf, n_layers=args.n_layers, attention=bool(args.attention)).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    loss_l1 = nn.L1Loss()

    res = {"epochs": [], "losess": [], "best_val": 1e10, "best_test": 1e10, "best_epoch": 0}
    ckpt_dir = os.path.join(args.outf, args.exp_name)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            pred = model(node_features(data.z), data.pos, data.batch, data.num_graphs)
            loss = loss_l1(pred, (data.y[:, target] - meann) / mad)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} iter {i} loss {loss.item() * mad:.5f}", flush=True)
        lr_scheduler.step()

        if epoch % args.test_interval == 0:
            val_loss = test(model.module, val_loader, target, meann, mad, device)
            test_loss = test(model.module, test_loader, target, meann, mad, device)
            if rank == 0:
                res["epochs"].append(epoch)
                res["losess"].append(test_loss)
                if val_loss < res["best_val"]:
                    res.update(best_val=val_loss, best_test=test_loss, best_epoch=epoch)
                    torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.pt"))
                print(f"*** epoch {epoch} val {val_loss:.5f} test {test_loss:.5f} | best val {res['best_val']:.5f} "
                      f"test {res['best_test']:.5f} @ {res['best_epoch']} ({time.time() - t0:.0f}s)", flush=True)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
