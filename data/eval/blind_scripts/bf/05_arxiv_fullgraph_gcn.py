"""Full-batch GCN on ogbn-arxiv with DDP.

Every rank keeps the whole graph on its GPU (arxiv is small) and runs a
full-graph forward pass; the loss of each rank is taken over its own slice
of the training nodes, so the all-reduced gradient covers the full train set.

    torchrun --standalone --nproc_per_node=4 05_arxiv_fullgraph_gcn.py --epochs 500
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch_geometric.nn import GCNConv


class GCN(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers, dropout):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.bns = torch.nn.ModuleList()
        self.convs.append(GCNConv(in_channels, hidden_channels, cached=True))
        self.bns.append(torch.nn.BatchNorm1d(hidden_channels))
        for _ in range(num_layers - 2):
            self.convs.append(GCNConv(hidden_channels, hidden_channels, cached=True))
            self.bns.append(torch.nn.BatchNorm1d(hidden_channels))
        self.convs.append(GCNConv(hidden_channels, out_channels, cached=True))
        self.dropout = dropout

    def forward(self, x, adj_t):
        for conv, bn in zip(self.convs[:-1], self.bns):
            x = conv(x, adj_t)
            x = bn(x)
            x = F.relu(x)
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, adj_t)


def parse_args():
    parser = argparse.ArgumentParser(description="OGBN-Arxiv (GCN, full-batch, DDP)")
    parser.add_argument("--root", default="/datasets/ogb")
    parser.add_argument("--num_layers", type=int, default=3)
    parser.add_argument("--hidden_channels", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--patience", type=int, default=100)
    parser.add_argument("--log_steps", type=int, default=10)
    parser.add_argument("--ckpt_dir", default="/shared/ckpt/arxiv_gcn")
    parser.add_argument("--resume", default="")
    return parser.parse_args()


@torch.no_grad()
def local_accuracy(out, y, idx):
    pred = out[idx].argmax(dim=-1)
    return torch.stack([(pred == y[idx]).sum(), torch.tensor(idx.numel(), device=out.device)])


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        PygNodePropPredDataset(name="ogbn-arxiv", root=args.root)
    dist.barrier()
    dataset = PygNodePropPredDataset(name="ogbn-arxiv", root=args.root,
                                     transform=T.ToSparseTensor())
    data = dataset[0]
    data.adj_t = data.adj_t.to_symmetric()
    data = data.to(device)
    y = data.y.squeeze(1)

    split_idx = dataset.get_idx_split()
    train_idx = split_idx["train"].to(device)
    local_train = train_idx.tensor_split(world_size)[rank]
    local_valid = split_idx["valid"].to(device).tensor_split(world_size)[rank]
    local_test = split_idx["test"].to(device).tensor_split(world_size)[rank]
    evaluator = Evaluator(name="ogbn-arxiv")

    torch.manual_seed(0)
    model = GCN(data.num_features, args.hidden_channels, dataset.num_classes,
                args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    start_epoch, best_val, best_test, bad_epochs = 1, 0.0, 0.0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        best_val, best_test = ckpt["best_val"], ckpt["best_test"]

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs + 1):
        t0 = time.time()
        model.train()
        optimizer.zero_grad()
        out = model(data.x, data.adj_t)
        loss = F.cross_entropy(out[local_train], y[local_train])
        loss.backward()
        optimizer.step()

        model.eval()
        with torch.no_grad():
            out = model.module(data.x, data.adj_t)
        counts = torch.stack([local_accuracy(out, y, idx)
                              for idx in (local_train, local_valid, local_test)])
        dist.all_reduce(counts)
        train_acc, val_acc, test_acc = (counts[:, 0].double() / counts[:, 1].double()).tolist()

        loss_t = loss.detach().clone()
        dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)

        if val_acc > best_val:
            best_val, best_test, bad_epochs = val_acc, test_acc, 0
            if rank == 0:
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "best_val": best_val, "best_test": best_test},
                           os.path.join(args.ckpt_dir, "best.pt"))
        else:
            bad_epochs += 1

        if rank == 0 and epoch % args.log_steps == 0:
            print(f"Epoch {epoch:03d} | loss {loss_t.item():.4f} | train {100 * train_acc:.2f}% "
                  f"| valid {100 * val_acc:.2f}% | test {100 * test_acc:.2f}% "
                  f"| {time.time() - t0:.2f}s", flush=True)

        # all ranks see the same reduced val_acc, so they stop on the same epoch
        if bad_epochs >= args.patience:
            if rank == 0:
                print(f"early stopping at epoch {epoch}")
            break

    if rank == 0:
        # cross-check with the official evaluator on the full splits
        state = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
        model.module.load_state_dict(state["model"])
        model.eval()
        with torch.no_grad():
            y_pred = model.module(data.x, data.adj_t).argmax(dim=-1, keepdim=True)
        for split in ("valid", "test"):
            idx = split_idx[split].to(device)
            acc = evaluator.eval({"y_true": data.y[idx], "y_pred": y_pred[idx]})["acc"]
            print(f"final {split} acc (epoch {state['epoch']}): {100 * acc:.2f}%")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
