"""GraphSAGE on ogbn-products: NeighborLoader driven by a DistributedSampler
over the training seeds, so every GPU gets a disjoint, equally sized share.

    torchrun --standalone --nproc_per_node=4 20_products_sage_distsampler.py \
        --epochs 30 --tb_dir runs/sage_ds
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGERes(nn.Module):
    """GraphSAGE with a linear input encoder, residual hidden layers and LayerNorm."""

    def __init__(self, in_dim, hidden, out_dim, num_layers=3, dropout=0.4):
        super().__init__()
        self.encoder = nn.Linear(in_dim, hidden)
        self.convs = nn.ModuleList(SAGEConv(hidden, hidden) for _ in range(num_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(num_layers))
        self.head = nn.Linear(hidden, out_dim)
        self.dropout = dropout

    def forward(self, x, edge_index):
        x = F.relu(self.encoder(x))
        for conv, norm in zip(self.convs, self.norms):
            h = F.relu(norm(conv(x, edge_index)))
            x = x + F.dropout(h, p=self.dropout, training=self.training)
        return self.head(x)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        acc[0] += (out.argmax(-1) == batch.y[: batch.batch_size].view(-1)).sum()
        acc[1] += batch.batch_size
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.4)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tb_dir", default="runs/sage_ds")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    data = dataset[0]
    split = dataset.get_idx_split()
    train_idx = split["train"]

    train_sampler = DistributedSampler(range(train_idx.numel()), num_replicas=world_size,
                                       rank=rank, shuffle=True, seed=args.seed)
    train_loader = NeighborLoader(
        data, input_nodes=train_idx, num_neighbors=args.fanout,
        batch_size=args.batch_size, sampler=train_sampler,
        num_workers=args.workers, persistent_workers=True,
    )
    val_loader = NeighborLoader(
        data, input_nodes=split["valid"].tensor_split(world_size)[rank],
        num_neighbors=args.fanout, batch_size=4096, num_workers=2,
    )
    test_loader = NeighborLoader(
        data, input_nodes=split["test"].tensor_split(world_size)[rank],
        num_neighbors=args.fanout, batch_size=4096, num_workers=2,
    )

    model = SAGERes(dataset.num_features, args.hidden, dataset.num_classes,
                    args.layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-5)
    warmup = 2 * len(train_loader)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * max(0.0, (total - step) / total),
    )

    writer = SummaryWriter(args.tb_dir) if rank == 0 else None
    best_val, global_step = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1
            running[0] += loss.detach()
            running[1] += 1
            if writer is not None and global_step % 50 == 0:
                writer.add_scalar("train/loss_rank0", loss.item(), global_step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)
        dist.all_reduce(running)

        val_acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            writer.add_scalar("train/epoch_loss", (running[0] / running[1]).item(), epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            print(f"epoch {epoch:02d} | loss {(running[0] / running[1]).item():.4f} | "
                  f"val {val_acc:.4f} | {time.time() - t0:.1f}s", flush=True)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.tb_dir, "best.pt"))
        dist.barrier()

    model.module.load_state_dict(
        torch.load(os.path.join(args.tb_dir, "best.pt"), map_location=device))
    test_acc = evaluate(model.module, test_loader, device)
    if rank == 0:
        print(f"best val {best_val:.4f} | test {test_acc:.4f}")
        writer.add_scalar("test/acc", test_acc, args.epochs)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
