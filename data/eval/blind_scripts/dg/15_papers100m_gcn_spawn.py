"""ogbn-papers100M node classification with a sampled GCN (PyG), single node,
multi-GPU. The dataset is read once in the parent and passed to the spawned
workers through shared memory.

    python 15_papers100m_gcn_spawn.py --n_devices 8 --epochs 10
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GCNConv


def get_num_workers(world_size):
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count()
    return max(1, n // (2 * world_size))


class GCN(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers=3, dropout=0.5):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.convs.append(GCNConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(GCNConv(hidden_channels, hidden_channels))
        self.convs.append(GCNConv(hidden_channels, out_channels))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for conv in self.convs[:-1]:
            x = F.relu(conv(x, edge_index))
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)


@torch.no_grad()
def evaluate(model, loader, device="cuda:0", max_steps=None):
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    seen = torch.zeros((), dtype=torch.long, device=device)
    for i, batch in enumerate(loader):
        if max_steps is not None and i >= max_steps:
            break
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y = batch.y[: batch.batch_size].view(-1).long()
        correct += (out.argmax(dim=-1) == y).sum()
        seen += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    return correct.item() / max(seen.item(), 1)


def run(rank, world_size, data, split_idx, num_classes, args):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(args.master_port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    def shard(idx):
        n = idx.size(0) // world_size
        return idx[rank * n:(rank + 1) * n].clone()

    train_idx = shard(split_idx["train"])
    valid_idx = shard(split_idx["valid"])
    test_idx = shard(split_idx["test"])

    num_workers = get_num_workers(world_size)
    kwargs = dict(num_neighbors=[args.fan_out] * args.num_layers, num_workers=num_workers)
    train_loader = NeighborLoader(data, input_nodes=train_idx, batch_size=args.batch_size,
                                  shuffle=True, drop_last=True, persistent_workers=True, **kwargs)
    valid_loader = NeighborLoader(data, input_nodes=valid_idx, batch_size=args.batch_size, **kwargs)
    test_loader = NeighborLoader(data, input_nodes=test_idx, batch_size=args.batch_size, **kwargs)

    torch.manual_seed(12345)
    model = GCN(data.num_features, args.hidden_channels, num_classes, args.num_layers).to(device)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)

    dist.barrier()
    if rank == 0:
        print(f"{world_size} GPUs, {len(train_loader)} train batches per GPU", flush=True)

    best_valid = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for i, batch in enumerate(train_loader):
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1).long())
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(loss_sum)

        valid_acc = evaluate(model.module, valid_loader, max_steps=args.eval_steps)
        if rank == 0:
            print(f"Epoch {epoch:02d} | loss {(loss_sum[0] / loss_sum[1]).item():.4f} | "
                  f"valid acc {valid_acc * 100:.2f}% | {time.time() - t0:.0f}s", flush=True)
            if valid_acc > best_valid:
                best_valid = valid_acc
                torch.save(model.module.state_dict(), args.save_path)
        dist.barrier()

    test_acc = evaluate(model.module, test_loader)
    if rank == 0:
        print(f"Test acc {test_acc * 100:.2f}% (best valid {best_valid * 100:.2f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/datasets/ogb")
    parser.add_argument("--hidden_channels", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--fan_out", type=int, default=15)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--eval_steps", type=int, default=None)
    parser.add_argument("--n_devices", type=int, default=-1)
    parser.add_argument("--master_port", type=int, default=12355)
    parser.add_argument("--save_path", default="gcn_papers100m.pt")
    args = parser.parse_args()

    dataset = PygNodePropPredDataset(name="ogbn-papers100M", root=args.root)
    split_idx = dataset.get_idx_split()
    data = dataset[0]
    data.y = data.y.reshape(-1)
    num_classes = dataset.num_classes

    world_size = torch.cuda.device_count()
    if args.n_devices > 0:
        world_size = min(args.n_devices, world_size)
    print("Data:", data, "| GPUs:", world_size)
    mp.spawn(run, args=(world_size, data, split_idx, num_classes, args),
             nprocs=world_size, join=True)
