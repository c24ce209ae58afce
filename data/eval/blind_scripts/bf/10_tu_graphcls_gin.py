"""Graph classification on TU benchmarks (NCI1, PROTEINS, ...) with GIN + DDP.

Fixed 80/10/10 split drawn from a seeded generator so every rank agrees on it.

    torchrun --standalone --nproc_per_node=4 10_tu_graphcls_gin.py --name NCI1
"""
import argparse
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.datasets import TUDataset
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GINConv, global_add_pool

logger = logging.getLogger("tu_gin")


class GIN(nn.Module):
    def __init__(self, in_channels, hidden, num_classes, num_layers=5, dropout=0.5):
        super().__init__()
        self.convs = nn.ModuleList()
        for i in range(num_layers):
            mlp = nn.Sequential(
                nn.Linear(in_channels if i == 0 else hidden, hidden),
                nn.ReLU(),
                nn.Linear(hidden, hidden),
            )
            self.convs.append(GINConv(mlp, train_eps=True))
        self.lin1 = nn.Linear(num_layers * hidden, hidden)
        self.lin2 = nn.Linear(hidden, num_classes)
        self.dropout = dropout

    def forward(self, x, edge_index, batch):
        xs = []
        for conv in self.convs:
            x = F.relu(conv(x, edge_index))
            xs.append(global_add_pool(x, batch))
        h = F.relu(self.lin1(torch.cat(xs, dim=-1)))
        h = F.dropout(h, p=self.dropout, training=self.training)
        return self.lin2(h)


def split_dataset(dataset, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(dataset), generator=g).tolist()
    n_train = int(0.8 * len(dataset))
    n_val = int(0.1 * len(dataset))
    return perm[:n_train], perm[n_train:n_train + n_val], perm[n_train + n_val:]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for data in loader:
        data = data.to(device)
        pred = model(data.x, data.edge_index, data.batch).argmax(dim=-1)
        correct += int((pred == data.y).sum())
        total += data.num_graphs
    stats = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", default="NCI1")
    parser.add_argument("--root", default="data/TUDataset")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt", default="checkpoints/tu_gin_best.pt")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    if rank == 0:
        TUDataset(args.root, name=args.name)
    dist.barrier()
    dataset = TUDataset(args.root, name=args.name)
    train_ids, val_ids, test_ids = split_dataset(dataset, args.seed)
    logger.info("%s: %d graphs (%d/%d/%d), %d features, %d classes", args.name, len(dataset),
                len(train_ids), len(val_ids), len(test_ids),
                dataset.num_features, dataset.num_classes)

    train_set = Subset(dataset, train_ids)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    # evaluation: each rank scores a strided slice, no padding
    val_loader = DataLoader(Subset(dataset, val_ids[rank::world_size]), batch_size=128)
    test_loader = DataLoader(Subset(dataset, test_ids[rank::world_size]), batch_size=128)

    model = GIN(dataset.num_features, args.hidden, dataset.num_classes,
                num_layers=args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)

    best_val, test_at_best = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device)
            optimizer.zero_grad()
            out = model(data.x, data.edge_index, data.batch)
            loss = F.cross_entropy(out, data.y)
            loss.backward()
            optimizer.step()
            running[0] += loss.detach() * data.num_graphs
            running[1] += data.num_graphs
        scheduler.step()
        dist.all_reduce(running)
        train_loss = (running[0] / running[1]).item()

        val_acc = evaluate(model.module, val_loader, device)
        test_acc = evaluate(model.module, test_loader, device)
        if val_acc > best_val:
            best_val, test_at_best = val_acc, test_acc
            if rank == 0:
                os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                torch.save(model.module.state_dict(), args.ckpt)
        if epoch % 10 == 0:
            logger.info("epoch %03d loss %.4f val %.4f test %.4f lr %.5f", epoch,
                        train_loss, val_acc, test_acc,
                        scheduler.get_last_lr()[0])

    logger.info("best val %.4f, test at best val %.4f", best_val, test_at_best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
