"""GraphSAGE on ogbn-products with neighbour sampling, data-parallel over GPUs.

    torchrun --standalone --nproc_per_node=4 01_sage_products_neighbor.py \
        --root /data/ogb --epochs 20
"""
import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


def get_args():
    parser = argparse.ArgumentParser("GraphSAGE / ogbn-products (DDP)")
    parser.add_argument("--root", type=str, default="/data/ogb")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--fanout", type=str, default="15,10,5")
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval_every", type=int, default=2)
    parser.add_argument("--num_workers", type=int, default=6)
    parser.add_argument("--infer_batch_size", type=int, default=4096)
    parser.add_argument("--out_dir", type=str, default="runs/sage_products")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden, out_channels, num_layers, dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden))
        for _ in range(num_layers - 2):
            self.convs.append(SAGEConv(hidden, hidden))
        self.convs.append(SAGEConv(hidden, out_channels))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, loader, device):
        # layer-wise: every node's full neighbourhood, one layer at a time
        for i, conv in enumerate(self.convs):
            xs = []
            for batch in loader:
                x = x_all[batch.n_id].to(device)
                x = conv(x, batch.edge_index.to(device))
                if i < len(self.convs) - 1:
                    x = F.relu(x)
                xs.append(x[: batch.batch_size].cpu())
            x_all = torch.cat(xs, dim=0)
        return x_all


def train_one_epoch(model, loader, optimizer, device):
    model.train()
    loss_sum = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y = batch.y[: batch.batch_size]
        loss = F.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        loss_sum[0] += loss.detach() * batch.batch_size
        loss_sum[1] += batch.batch_size
    dist.all_reduce(loss_sum)
    return (loss_sum[0] / loss_sum[1]).item()


@torch.no_grad()
def evaluate(model, data, subgraph_loader, split_idx, evaluator, device):
    model.eval()
    out = model.inference(data.x, subgraph_loader, device)
    y_pred = out.argmax(dim=-1, keepdim=True)
    y_true = data.y.view(-1, 1)
    results = {}
    for split in ("train", "valid", "test"):
        idx = split_idx[split]
        results[split] = evaluator.eval(
            {"y_true": y_true[idx], "y_pred": y_pred[idx]}
        )["acc"]
    return results


def main():
    args = get_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    # rank 0 downloads and processes, the others read the processed files
    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    split_idx = dataset.get_idx_split()
    data = dataset[0]
    data.y = data.y.view(-1)
    evaluator = Evaluator(name="ogbn-products")

    fanout = [int(f) for f in args.fanout.split(",")]
    assert len(fanout) == args.num_layers

    train_loader = NeighborLoader(
        data,
        input_nodes=split_idx["train"],
        num_neighbors=fanout,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        persistent_workers=True,
    )

    subgraph_loader = None
    if rank == 0:
        subgraph_loader = NeighborLoader(
            copy.copy(data),
            input_nodes=None,
            num_neighbors=[-1],
            batch_size=args.infer_batch_size,
            shuffle=False,
            num_workers=args.num_workers,
        )
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        print(f"world_size={world_size}  train seeds={split_idx['train'].numel()}"
              f"  batches/epoch={len(train_loader)}", flush=True)

    model = SAGE(
        dataset.num_features, args.hidden, dataset.num_classes,
        args.num_layers, args.dropout,
    ).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay
    )

    best_val, best_test = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        t0 = time.time()
        loss = train_one_epoch(model, train_loader, optimizer, device)
        if rank == 0:
            print(f"epoch {epoch:03d} | loss {loss:.4f} | "
                  f"{time.time() - t0:.1f}s", flush=True)

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            if rank == 0:
                res = evaluate(model.module, data, subgraph_loader,
                               split_idx, evaluator, device)
                print(f"  train {res['train']:.4f}  valid {res['valid']:.4f}"
                      f"  test {res['test']:.4f}", flush=True)
                if res["valid"] > best_val:
                    best_val, best_test = res["valid"], res["test"]
                    torch.save(
                        {"epoch": epoch, "model": model.module.state_dict(),
                         "valid": best_val, "test": best_test},
                        os.path.join(args.out_dir, "best.pt"),
                    )
            dist.barrier()

    if rank == 0:
        print(f"best valid {best_val:.4f}  test@best {best_test:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
