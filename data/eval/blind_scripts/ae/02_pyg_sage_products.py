"""GraphSAGE on ogbn-products with neighbour sampling, one process per GPU.

    torchrun --standalone --nproc_per_node=8 02_pyg_sage_products.py --root /data/ogb
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers=3, dropout=0.5):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.norms = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))
        for _ in range(num_layers - 1):
            self.norms.append(torch.nn.LayerNorm(hidden_channels))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = self.norms[i](x)
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


def get_args():
    parser = argparse.ArgumentParser(description="ogbn-products GraphSAGE (DDP)")
    parser.add_argument("--root", type=str, default="data/ogb")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=3)
    parser.add_argument("--fanout", type=str, default="15,10,5")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--eval-batch-size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--num-workers", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--ckpt-dir", type=str, default="checkpoints/sage_products")
    return parser.parse_args()


@torch.no_grad()
def evaluate(model, data, idx, fanout, batch_size, device, num_workers):
    """Sampled evaluation over this rank's slice of `idx`; returns global correct/total."""
    model.eval()
    loader = NeighborLoader(data, input_nodes=idx, num_neighbors=fanout,
                            batch_size=batch_size, shuffle=False,
                            num_workers=num_workers)
    correct = torch.zeros(1, device=device, dtype=torch.long)
    total = torch.zeros(1, device=device, dtype=torch.long)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        out = model(batch.x, batch.edge_index)[:batch.batch_size]
        pred = out.argmax(dim=-1)
        y = batch.y[:batch.batch_size].view(-1)
        correct += (pred == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return correct.item() / max(total.item(), 1)


def run(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    # download / process once, then let the other ranks read the processed files
    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    split_idx = dataset.get_idx_split()
    data = dataset[0]
    data.y = data.y.view(-1)

    fanout = [int(f) for f in args.fanout.split(",")]
    train_idx = split_idx["train"]
    valid_idx = split_idx["valid"].tensor_split(world_size)[rank]
    test_idx = split_idx["test"].tensor_split(world_size)[rank]

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

    torch.manual_seed(12345)
    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes,
                 num_layers=args.num_layers, dropout=args.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"world_size={world_size} train={train_idx.numel()} "
              f"batches/epoch={len(train_loader)}", flush=True)

    best_val, history = 0.0, []
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            optimizer.step()
            loss_sum[0] += loss.detach() * batch.batch_size
            loss_sum[1] += batch.batch_size
        scheduler.step()
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()
        epoch_time = time.time() - t0

        record = {"epoch": epoch, "loss": train_loss, "time": epoch_time}
        if epoch % args.eval_every == 0 or epoch == args.epochs:
            val_acc = evaluate(model, data, valid_idx, fanout, args.eval_batch_size,
                               device, args.num_workers)
            test_acc = evaluate(model, data, test_idx, fanout, args.eval_batch_size,
                                device, args.num_workers)
            record.update(val_acc=val_acc, test_acc=test_acc)
            if rank == 0 and val_acc > best_val:
                best_val = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "val_acc": val_acc,
                            "args": vars(args)},
                           os.path.join(args.ckpt_dir, "best.pt"))
        if rank == 0:
            history.append(record)
            print(json.dumps(record), flush=True)
        dist.barrier()

    if rank == 0:
        with open(os.path.join(args.ckpt_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
        print(f"best val acc {best_val:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(get_args())
