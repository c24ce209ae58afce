"""Cluster-GCN on ogbn-products, distributed over GPUs with DDP.

METIS partitions are computed once (rank 0) and cached in --cluster_dir;
every epoch each rank draws its own share of the partitions.

    torchrun --nproc_per_node=4 14_products_clustergcn_ddp.py --num_parts 15000
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch_geometric.loader import ClusterData, ClusterLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.utils import index_to_mask


def get_parser():
    parser = argparse.ArgumentParser(description="OGBN-Products (Cluster-GCN)")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--root", default="/data/ogb")
    parser.add_argument("--cluster_dir", default="/data/ogb/products_clusters")
    parser.add_argument("--num_parts", type=int, default=15000)
    parser.add_argument("--parts_per_batch", type=int, default=32)
    parser.add_argument("--num_workers", type=int, default=6)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--hidden_channels", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--eval_steps", type=int, default=5)
    parser.add_argument("--save_path", default="checkpoints/clustergcn_products.pt")
    return parser


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers, dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for conv in self.convs[:-1]:
            x = F.relu(conv(x, edge_index))
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)


@torch.no_grad()
def evaluate(model, loader, evaluator, device):
    model.eval()
    y_true = {"train": [], "valid": [], "test": []}
    y_pred = {"train": [], "valid": [], "test": []}
    for batch in loader:
        batch = batch.to(device)
        pred = model(batch.x, batch.edge_index).argmax(dim=-1, keepdim=True)
        for split in y_true:
            mask = batch[f"{split}_mask"]
            y_true[split].append(batch.y[mask].cpu())
            y_pred[split].append(pred[mask].cpu())
    return {split: evaluator.eval({"y_true": torch.cat(y_true[split]),
                                   "y_pred": torch.cat(y_pred[split])})["acc"]
            for split in y_true}


def main():
    args = get_parser().parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    if rank == 0:
        PygNodePropPredDataset(name="ogbn-products", root=args.root)
    dist.barrier()
    dataset = PygNodePropPredDataset(name="ogbn-products", root=args.root)
    split_idx = dataset.get_idx_split()
    data = dataset[0]
    for split in ("train", "valid", "test"):
        data[f"{split}_mask"] = index_to_mask(split_idx[split], size=data.num_nodes)

    # METIS is slow on products: let rank 0 build the partition cache first
    if rank == 0:
        ClusterData(data, num_parts=args.num_parts, recursive=False, save_dir=args.cluster_dir)
    dist.barrier()
    cluster_data = ClusterData(data, num_parts=args.num_parts, recursive=False,
                               save_dir=args.cluster_dir)

    train_sampler = DistributedSampler(range(len(cluster_data)), shuffle=True)
    train_loader = ClusterLoader(cluster_data, batch_size=args.parts_per_batch,
                                 sampler=train_sampler, num_workers=args.num_workers)
    eval_loader = ClusterLoader(cluster_data, batch_size=args.parts_per_batch * 4,
                                shuffle=False, num_workers=args.num_workers)
    evaluator = Evaluator(name="ogbn-products")

    model = SAGE(data.num_features, args.hidden_channels, dataset.num_classes,
                 args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_valid = 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[batch.train_mask]
            loss = F.cross_entropy(out, batch.y.squeeze(1)[batch.train_mask])
            loss.backward()
            optimizer.step()
            n = batch.train_mask.sum()
            loss_sum += torch.stack([loss.detach() * n, n.float()])
        dist.all_reduce(loss_sum)

        if rank == 0:
            print(f"Epoch {epoch:02d} | loss {(loss_sum[0] / loss_sum[1]).item():.4f} | "
                  f"{time.time() - tic:.1f}s", flush=True)

        if rank == 0 and epoch % args.eval_steps == 0:
            result = evaluate(model.module, eval_loader, evaluator, device)
            print(f"Epoch {epoch:02d} | train {100 * result['train']:.2f}% | "
                  f"valid {100 * result['valid']:.2f}% | test {100 * result['test']:.2f}%",
                  flush=True)
            if result["valid"] > best_valid:
                best_valid = result["valid"]
                os.makedirs(os.path.dirname(args.save_path), exist_ok=True)
                torch.save(model.module.state_dict(), args.save_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
