"""Multi-GPU GraphSAGE on ogbn-products with neighbour sampling.

Each process owns one GPU and a disjoint slice of the training nodes.
Mini-batches are built with PyG's NeighborLoader from the CPU copy of the
graph; features are moved to the GPU per batch.

    torchrun --standalone --nproc_per_node=4 01_products_sage_neighbor.py --epochs 20
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


def parse_args():
    p = argparse.ArgumentParser(description="ogbn-products GraphSAGE (DDP)")
    p.add_argument("--root", default="/data/ogb")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--fanout", type=str, default="15,10,5")
    p.add_argument("--eval_batch_size", type=int, default=4096)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--eval_every", type=int, default=2)
    p.add_argument("--out_dir", default="runs/products_sage")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class SAGE(torch.nn.Module):
    def __init__(self, in_dim, hidden, out_dim, num_layers, dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList([SAGEConv(in_dim, hidden)])
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden, hidden))
        self.convs.append(SAGEConv(hidden, out_dim))
        self.dropout = dropout

    def reset_parameters(self):
        for conv in self.convs:
            conv.reset_parameters()

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


def log(rank, msg):
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@torch.no_grad()
def evaluate(model, loader, device):
    """Returns (correct, total) over the seed nodes of `loader`."""
    model.eval()
    correct = torch.zeros(1, device=device, dtype=torch.long)
    total = torch.zeros(1, device=device, dtype=torch.long)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y = batch.y[: batch.batch_size]
        correct += (out.argmax(dim=-1) == y).sum()
        total += y.numel()
    return correct, total


def main():
    args = parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    dataset = PygNodePropPredDataset(name="ogbn-products", root=args.root)
    split_idx = dataset.get_idx_split()
    data = dataset[0]
    data.y = data.y.view(-1)
    log(rank, f"loaded ogbn-products: {data.num_nodes} nodes, {data.num_edges} edges")

    # Same permutation on every rank, then each rank takes its own slice.
    gen = torch.Generator().manual_seed(args.seed)
    train_idx = split_idx["train"]
    train_idx = train_idx[torch.randperm(train_idx.numel(), generator=gen)]
    per_rank = train_idx.numel() // world_size
    train_idx = train_idx[rank * per_rank:(rank + 1) * per_rank]

    valid_idx = split_idx["valid"].tensor_split(world_size)[rank]
    test_idx = split_idx["test"].tensor_split(world_size)[rank]

    fanout = [int(f) for f in args.fanout.split(",")]
    assert len(fanout) == args.num_layers

    train_loader = NeighborLoader(
        data,
        input_nodes=train_idx,
        num_neighbors=fanout,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    eval_kwargs = dict(
        num_neighbors=[20] * args.num_layers,
        batch_size=args.eval_batch_size,
        shuffle=False,
        num_workers=args.num_workers,
    )
    valid_loader = NeighborLoader(data, input_nodes=valid_idx, **eval_kwargs)
    test_loader = NeighborLoader(data, input_nodes=test_idx, **eval_kwargs)

    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes,
                 args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr,
                                 weight_decay=args.weight_decay)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_val, best_test = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        total_loss = torch.zeros(1, device=device)
        n_steps = 0
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            optimizer.step()
            total_loss += loss.detach()
            n_steps += 1

        dist.all_reduce(total_loss)
        avg_loss = total_loss.item() / (n_steps * world_size)
        log(rank, f"epoch {epoch:03d} | loss {avg_loss:.4f} | {time.time() - t0:.1f}s")

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            stats = []
            for loader in (valid_loader, test_loader):
                correct, total = evaluate(model.module, loader, device)
                dist.all_reduce(correct)
                dist.all_reduce(total)
                stats.append(correct.item() / max(total.item(), 1))
            val_acc, test_acc = stats
            log(rank, f"epoch {epoch:03d} | val {val_acc:.4f} | test {test_acc:.4f}")

            if val_acc > best_val:
                best_val, best_test = val_acc, test_acc
                if rank == 0:
                    torch.save(
                        {"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "val_acc": val_acc},
                        os.path.join(args.out_dir, "best.pt"),
                    )

    log(rank, f"best val {best_val:.4f} | test at best val {best_test:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
