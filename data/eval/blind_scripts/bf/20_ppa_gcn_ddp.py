"""ogbg-ppa (37-way species classification of PPI graphs) with GCN + DDP.

ppa graphs have no node features, so every node starts from the same
learned embedding; the 7-dim edge features are projected and used in
the message function.

    torchrun --standalone --nproc_per_node=8 20_ppa_gcn_ddp.py --batch_size 32
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from ogb.graphproppred import Evaluator, PygGraphPropPredDataset
from torch_geometric.loader import DataLoader
from torch_geometric.nn import MessagePassing, global_mean_pool
from torch_geometric.utils import degree


def add_zeros(data):
    data.x = torch.zeros(data.num_nodes, dtype=torch.long)
    return data


class GCNConv(MessagePassing):
    def __init__(self, emb_dim):
        super().__init__(aggr="add")
        self.linear = nn.Linear(emb_dim, emb_dim)
        self.root_emb = nn.Embedding(1, emb_dim)
        self.edge_encoder = nn.Linear(7, emb_dim)

    def forward(self, x, edge_index, edge_attr):
        x = self.linear(x)
        edge_embedding = self.edge_encoder(edge_attr)
        row, col = edge_index
        deg = degree(row, x.size(0), dtype=x.dtype) + 1
        deg_inv_sqrt = deg.pow(-0.5)
        deg_inv_sqrt[deg_inv_sqrt == float("inf")] = 0
        norm = deg_inv_sqrt[row] * deg_inv_sqrt[col]
        return self.propagate(edge_index, x=x, edge_attr=edge_embedding, norm=norm) + \
            F.relu(x + self.root_emb.weight) * 1.0 / deg.view(-1, 1)

    def message(self, x_j, edge_attr, norm):
        return norm.view(-1, 1) * F.relu(x_j + edge_attr)


class GCN(nn.Module):
    def __init__(self, num_classes, num_layer=5, emb_dim=300, drop_ratio=0.5):
        super().__init__()
        self.node_encoder = nn.Embedding(1, emb_dim)
        self.convs = nn.ModuleList([GCNConv(emb_dim) for _ in range(num_layer)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(emb_dim) for _ in range(num_layer)])
        self.drop_ratio = drop_ratio
        self.head = nn.Linear(emb_dim, num_classes)

    def forward(self, data):
        h = self.node_encoder(data.x)
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            h_new = norm(conv(h, data.edge_index, data.edge_attr))
            if i < len(self.convs) - 1:
                h_new = F.relu(h_new)
            h = h + F.dropout(h_new, self.drop_ratio, training=self.training)
        return self.head(global_mean_pool(h, data.batch))


@torch.no_grad()
def evaluate(model, loader, evaluator, device):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch)
        y_true.append(batch.y.view(-1, 1).cpu())
        y_pred.append(pred.argmax(dim=-1, keepdim=True).cpu())
    return evaluator.eval({"y_true": torch.cat(y_true), "y_pred": torch.cat(y_pred)})["acc"]


def main():
    parser = argparse.ArgumentParser(description="ogbg-ppa GCN (DDP)")
    parser.add_argument("--root", default="/data/ogb")
    parser.add_argument("--num_layer", type=int, default=5)
    parser.add_argument("--emb_dim", type=int, default=300)
    parser.add_argument("--drop_ratio", type=float, default=0.5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--ckpt_dir", default="checkpoints/ppa_gcn")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        PygGraphPropPredDataset(name="ogbg-ppa", root=args.root)
    dist.barrier()
    dataset = PygGraphPropPredDataset(name="ogbg-ppa", root=args.root, transform=add_zeros)
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator("ogbg-ppa")

    train_set = dataset[split_idx["train"]]
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, drop_last=True, pin_memory=True)
    valid_loader = DataLoader(dataset[split_idx["valid"]], batch_size=256,
                              num_workers=args.num_workers)
    test_loader = DataLoader(dataset[split_idx["test"]], batch_size=256,
                             num_workers=args.num_workers)

    model = GCN(dataset.num_classes, args.num_layer, args.emb_dim, args.drop_ratio)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{len(train_set)} training graphs, {len(train_loader)} steps/epoch/rank "
              f"on {world_size} GPUs", flush=True)

    best_valid = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for step, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            pred = model(batch)
            y = batch.y.view(-1)
            loss = F.cross_entropy(pred, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stats += torch.stack([loss.detach() * y.numel(),
                                  (pred.argmax(-1) == y).sum().float(),
                                  torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(stats)

        if rank == 0:
            valid_acc = evaluate(model.module, valid_loader, evaluator, device)
            print(f"epoch {epoch:03d} | loss {(stats[0] / stats[2]).item():.4f} | "
                  f"train acc {(stats[1] / stats[2]).item():.4f} | valid {valid_acc:.4f} | "
                  f"{time.time() - t0:.0f}s", flush=True)
            if valid_acc > best_valid:
                best_valid = valid_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "valid_acc": valid_acc}, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        state = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
        model.module.load_state_dict(state["model"])
        test_acc = evaluate(model.module, test_loader, evaluator, device)
        print(f"best epoch {state['epoch']}: valid {state['valid_acc']:.4f} test {test_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
