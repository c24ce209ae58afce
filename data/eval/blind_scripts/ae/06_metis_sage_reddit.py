"""Partition-parallel GraphSAGE training.

The graph is split offline into one METIS partition per GPU
(tools/partition_graph.py --num-parts 8, which stores part_<i>.pt with halo nodes
and the local train/val masks). Each rank loads only its own partition, so the
full graph never has to fit in one process.

    torchrun --nproc_per_node=8 06_metis_sage_reddit.py --part-dir /scratch/reddit_8parts
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--part-dir", required=True)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fanouts", type=int, nargs="+", default=[25, 10])
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--log-dir", default="runs/part_sage")
    p.add_argument("--ckpt", default="checkpoints/part_sage.pt")
    return p.parse_args()


class SAGE(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, layers, dropout):
        super().__init__()
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.convs = nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i != len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, self.dropout, self.training)
        return x


def load_partition(part_dir, rank):
    part = torch.load(os.path.join(part_dir, f"part_{rank}.pt"))
    meta = torch.load(os.path.join(part_dir, "meta.pt"))
    return part, meta


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        counts[0] += (out.argmax(-1) == batch.y[: batch.batch_size]).sum()
        counts[1] += batch.batch_size
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    part, meta = load_partition(args.part_dir, rank)
    assert meta["num_parts"] == world, "re-partition the graph for this world size"

    # seed nodes: only the partition's own (non-halo) training / validation nodes
    inner = part.inner_mask
    train_nodes = (part.train_mask & inner).nonzero().view(-1)
    val_nodes = (part.val_mask & inner).nonzero().view(-1)

    train_loader = NeighborLoader(part, input_nodes=train_nodes, num_neighbors=args.fanouts,
                                  batch_size=args.batch_size, shuffle=True,
                                  num_workers=4, persistent_workers=True)
    val_loader = NeighborLoader(part, input_nodes=val_nodes, num_neighbors=[-1] * args.layers,
                                batch_size=2048, shuffle=False, num_workers=2)

    torch.manual_seed(0)
    model = SAGE(meta["num_features"], args.hidden, meta["num_classes"],
                 args.layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    if rank == 0:
        print(f"rank0 partition: {part.num_nodes} nodes ({int(inner.sum())} inner), "
              f"{train_nodes.numel()} train seeds", flush=True)

    best_acc = 0.0
    global_step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        total_loss = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total_loss[0] += loss.detach() * batch.batch_size
            total_loss[1] += batch.batch_size
            global_step += 1
        dist.all_reduce(total_loss)
        train_loss = (total_loss[0] / total_loss[1]).item()
        val_acc = evaluate(model, val_loader, device)

        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            writer.add_scalar("time/epoch", time.time() - t0, epoch)
            print(f"epoch {epoch:02d} loss {train_loss:.4f} val_acc {val_acc:.4f} "
                  f"({time.time() - t0:.1f}s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch,
                            "val_acc": val_acc}, args.ckpt)

    if rank == 0:
        writer.close()
        print(f"done, best val acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
