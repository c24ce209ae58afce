"""GATv2 on ogbn-products with NeighborLoader and DDP.

    torchrun --standalone --nproc_per_node=4 19_products_gatv2_final_test.py \
        --epochs 25 --run_name gatv2_h128
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GATv2Conv


class GATv2(torch.nn.Module):
    def __init__(self, in_dim, hidden, out_dim, heads=4, num_layers=3, dropout=0.3):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.convs.append(GATv2Conv(in_dim, hidden, heads=heads))
        for _ in range(num_layers - 2):
            self.convs.append(GATv2Conv(hidden * heads, hidden, heads=heads))
        self.convs.append(GATv2Conv(hidden * heads, out_dim, heads=1, concat=False))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.elu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


@torch.no_grad()
def evaluate(model, loader, device):
    """Accuracy over the seeds of all ranks."""
    model.eval()
    num = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device)
        logits = model(batch.x, batch.edge_index)[: batch.batch_size]
        num[0] += (logits.argmax(-1) == batch.y[: batch.batch_size].view(-1)).sum()
        num[1] += batch.batch_size
    dist.all_reduce(num)
    return (num[0] / num[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--runs_dir", default="runs")
    ap.add_argument("--run_name", default="gatv2")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--fanout", type=int, nargs="+", default=[10, 10, 10])
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    run_dir = os.path.join(args.runs_dir, args.run_name)

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
        os.makedirs(run_dir, exist_ok=True)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    data = dataset[0]
    idx = dataset.get_idx_split()

    n = idx["train"].numel() // world
    train_idx = idx["train"][rank * n:(rank + 1) * n]
    val_idx = idx["valid"].tensor_split(world)[rank]
    test_idx = idx["test"].tensor_split(world)[rank]

    train_loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=args.fanout,
                                  batch_size=args.batch_size, shuffle=True, drop_last=True,
                                  num_workers=4, persistent_workers=True)
    val_loader = NeighborLoader(data, input_nodes=val_idx, num_neighbors=args.fanout,
                                batch_size=4096, num_workers=2)
    test_loader = NeighborLoader(data, input_nodes=test_idx, num_neighbors=args.fanout,
                                 batch_size=4096, num_workers=2)

    model = GATv2(dataset.num_features, args.hidden, dataset.num_classes,
                  heads=args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    history = []
    best_val = 0.0
    best_path = os.path.join(run_dir, "best.pt")
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        s = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size].view(-1))
            loss.backward()
            optimizer.step()
            s[0] += loss.detach()
            s[1] += 1
        scheduler.step()
        dist.all_reduce(s)
        val_acc = evaluate(model.module, val_loader, device)

        if rank == 0:
            rec = {"epoch": epoch, "loss": (s[0] / s[1]).item(), "val_acc": val_acc,
                   "time": time.time() - t0}
            history.append(rec)
            print(json.dumps(rec), flush=True)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.module.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        model.module.load_state_dict(torch.load(best_path, map_location=device))
        test_acc = evaluate(model.module, test_loader, device)
        print(f"best val {best_val:.4f} | test {test_acc:.4f}", flush=True)
        with open(os.path.join(run_dir, "results.json"), "w") as f:
            json.dump({"history": history, "best_val": best_val, "test": test_acc,
                       "args": vars(args)}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
