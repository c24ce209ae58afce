"""Ego-subgraph classification for transaction fraud.

Every transaction is represented by its 2-hop ego network in the entity graph
(card, device, ip, email, shipping address), extracted offline by
extract_ego.py into one torch file per month. A GINE network with attention pooling
classifies the center transaction.

    torchrun --nproc_per_node=4 18_ego_subgraph_gin.py --root /data/ego_subgraphs
"""
import argparse
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.data import InMemoryDataset
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINEConv, AttentionalAggregation


class EgoSubgraphs(InMemoryDataset):
    def __init__(self, root, months):
        self.months = months
        super().__init__(root)
        self.load(self.processed_paths[0])

    @property
    def raw_file_names(self):
        return [f"ego_{m}.pt" for m in self.months]

    @property
    def processed_file_names(self):
        return [f"ego_{self.months[0]}_{self.months[-1]}.pt"]

    def process(self):
        graphs = []
        for path in self.raw_paths:
            graphs.extend(torch.load(path, weights_only=False))
        self.save(graphs, self.processed_paths[0])


class GINEFraud(nn.Module):
    def __init__(self, node_dim, edge_dim, hidden=128, layers=4, n_node_types=6):
        super().__init__()
        self.type_emb = nn.Embedding(n_node_types, hidden)
        self.node_in = nn.Linear(node_dim, hidden)
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        for _ in range(layers):
            mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
            self.convs.append(GINEConv(mlp, edge_dim=edge_dim))
            self.norms.append(nn.LayerNorm(hidden))
        self.pool = AttentionalAggregation(gate_nn=nn.Linear(hidden, 1))
        self.head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1))

    def forward(self, data):
        h = self.node_in(data.x) + self.type_emb(data.node_type)
        for conv, norm in zip(self.convs, self.norms):
            h = h + F.relu(norm(conv(h, data.edge_index, data.edge_attr)))
        g = self.pool(h, data.batch)
        center = h[data.ptr[:-1]]            # node 0 of every ego graph is the transaction itself
        return self.head(torch.cat([g, center], dim=-1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, dataset, device, rank, world, batch_size):
    model.eval()
    loader = DataLoader(dataset[rank::world], batch_size=batch_size, shuffle=False)
    ps, ys = [], []
    for data in loader:
        data = data.to(device)
        ps.append(torch.sigmoid(model.module(data)).cpu())
        ys.append(data.y.view(-1).cpu())
    out = [None] * world
    dist.all_gather_object(out, (torch.cat(ps).numpy(), torch.cat(ys).numpy()))
    p = np.concatenate([o[0] for o in out])
    y = np.concatenate([o[1] for o in out])
    return average_precision_score(y, p), roc_auc_score(y, p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--train-months", nargs="+", default=["2023-09", "2023-10", "2023-11", "2023-12", "2024-01"])
    ap.add_argument("--val-months", nargs="+", default=["2024-02"])
    ap.add_argument("--out", default="runs/ego_gine")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pos-weight", type=float, default=15.0)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    # rank 0 collates the monthly files once; the others wait and load the processed file
    if rank == 0:
        train_ds = EgoSubgraphs(args.root, args.train_months)
        val_ds = EgoSubgraphs(args.root, args.val_months)
    dist.barrier()
    if rank != 0:
        train_ds = EgoSubgraphs(args.root, args.train_months)
        val_ds = EgoSubgraphs(args.root, args.val_months)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                              pin_memory=True, drop_last=True)

    torch.manual_seed(0)
    model = GINEFraud(train_ds.num_node_features, train_ds.num_edge_features, args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=10)
    pos_weight = torch.tensor(args.pos_weight, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train graphs {len(train_ds)}  val graphs {len(val_ds)}  "
              f"train fraud rate {train_ds.y.float().mean():.4%}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for i, data in enumerate(train_loader):
            data = data.to(device, non_blocking=True)
            logit = model(data)
            loss = F.binary_cross_entropy_with_logits(logit, data.y.view(-1).float(), pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step(epoch + i / len(train_loader))
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        val_ap, val_auc = evaluate(model, val_ds, device, rank, world, 1024)
        if rank == 0:
            print(f"[{epoch:02d}] loss {(running[0] / running[1]).item():.4f}  val PR-AUC {val_ap:.4f}  "
                  f"ROC-AUC {val_auc:.4f}  lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:.0f}s", flush=True)
            if val_ap > best:
                best = val_ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_pr_auc": val_ap},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
