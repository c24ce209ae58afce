"""GIN with virtual node on ogbg-molhiv (binary HIV activity), multi-GPU.

    torchrun --nproc_per_node=4 08_molhiv_gin.py --epochs 100

requires: torch_geometric>=2.3, ogb
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from ogb.graphproppred.mol_encoder import AtomEncoder, BondEncoder
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import DataLoader
from torch_geometric.nn import MessagePassing, global_add_pool, global_mean_pool
from tqdm import tqdm


class GINConv(MessagePassing):
    def __init__(self, emb_dim):
        super().__init__(aggr="add")
        self.mlp = nn.Sequential(nn.Linear(emb_dim, 2 * emb_dim), nn.LayerNorm(2 * emb_dim), nn.ReLU(),
                                 nn.Linear(2 * emb_dim, emb_dim))
        self.eps = nn.Parameter(torch.zeros(1))
        self.bond_encoder = BondEncoder(emb_dim)

    def forward(self, x, edge_index, edge_attr):
        e = self.bond_encoder(edge_attr)
        return self.mlp((1 + self.eps) * x + self.propagate(edge_index, x=x, edge_attr=e))

    def message(self, x_j, edge_attr):
        return F.relu(x_j + edge_attr)


class GINVirtual(nn.Module):
    def __init__(self, num_layers=5, emb_dim=300, drop=0.5, num_tasks=1):
        super().__init__()
        self.atom_encoder = AtomEncoder(emb_dim)
        self.vn_emb = nn.Embedding(1, emb_dim)
        nn.init.zeros_(self.vn_emb.weight)
        self.convs = nn.ModuleList([GINConv(emb_dim) for _ in range(num_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(emb_dim) for _ in range(num_layers)])
        self.vn_mlps = nn.ModuleList([
            nn.Sequential(nn.Linear(emb_dim, 2 * emb_dim), nn.ReLU(), nn.Linear(2 * emb_dim, emb_dim), nn.ReLU())
            for _ in range(num_layers - 1)])
        self.drop = drop
        self.head = nn.Linear(emb_dim, num_tasks)

    def forward(self, data):
        x, edge_index, edge_attr, batch = data.x, data.edge_index, data.edge_attr, data.batch
        vn = self.vn_emb(torch.zeros(int(batch.max()) + 1, dtype=torch.long, device=x.device))
        h = self.atom_encoder(x)
        for i, conv in enumerate(self.convs):
            h = h + vn[batch]
            h_new = self.norms[i](conv(h, edge_index, edge_attr))
            if i < len(self.convs) - 1:
                h_new = F.relu(h_new)
            h_new = F.dropout(h_new, self.drop, training=self.training)
            if i < len(self.convs) - 1:
                vn = vn + F.dropout(self.vn_mlps[i](global_add_pool(h, batch) + vn), self.drop, training=self.training)
            h = h_new + h  # residual
        return self.head(global_mean_pool(h, batch))


@torch.no_grad()
def evaluate(model, loader, evaluator, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = batch.to(device)
        y_pred.append(model(batch).cpu())
        y_true.append(batch.y.view(-1, 1).cpu())
    return evaluator.eval({"y_true": torch.cat(y_true).numpy(), "y_pred": torch.cat(y_pred).numpy()})["rocauc"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="dataset")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch_size", type=int, default=32, help="graphs per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--emb_dim", type=int, default=300)
    ap.add_argument("--save", default="checkpoints/molhiv_gin.pt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # rank 0 downloads and processes the dataset, the others wait and then read it
    if rank == 0:
        dataset = PygGraphPropPredDataset(name="ogbg-molhiv", root=args.root)
    dist.barrier()
    if rank != 0:
        dataset = PygGraphPropPredDataset(name="ogbg-molhiv", root=args.root)
    split = dataset.get_idx_split()
    evaluator = Evaluator("ogbg-molhiv")

    train_loader = DataLoader(dataset[split["train"]], batch_size=args.batch_size, shuffle=True,
                              num_workers=4, drop_last=True)
    valid_loader = DataLoader(dataset[split["valid"]], batch_size=256, shuffle=False, num_workers=2)
    test_loader = DataLoader(dataset[split["test"]], batch_size=256, shuffle=False, num_workers=2)

    model = GINVirtual(args.layers, args.emb_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world_size)
    criterion = nn.BCEWithLogitsLoss()

    best_val, best_test = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        stats = torch.zeros(2, device=device)
        for batch in tqdm(train_loader, disable=rank != 0, desc=f"Epoch {epoch}"):
            batch = batch.to(device)
            pred = model(batch)
            is_labeled = batch.y == batch.y
            loss = criterion(pred[is_labeled], batch.y[is_labeled].float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats[0] += loss.detach() * batch.num_graphs
            stats[1] += batch.num_graphs
        dist.all_reduce(stats)

        if rank == 0:
            val_auc = evaluate(model.module, valid_loader, evaluator, device)
            test_auc = evaluate(model.module, test_loader, evaluator, device)
            print(f"epoch {epoch:3d} | train loss {(stats[0] / stats[1]).item():.4f} | valid {val_auc:.4f} | test {test_auc:.4f}")
            if val_auc > best_val:
                best_val, best_test = val_auc, test_auc
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "valid": val_auc}, args.save)
        dist.barrier()

    if rank == 0:
        print(f"best valid {best_val:.4f}, test at best valid {best_test:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
