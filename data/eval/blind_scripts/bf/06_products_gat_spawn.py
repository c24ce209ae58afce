"""GAT on ogbn-products, multi-GPU mini-batch training with mp.spawn.

Training uses sampled neighbourhoods; evaluation runs layer-wise inference
over the full graph on rank 0.

    python 06_products_gat_spawn.py --world_size 8 --epochs 50
"""
import argparse
import os
import os.path as osp
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn import Linear
from torch.nn.parallel import DistributedDataParallel
from ogb.nodeproppred import Evaluator, PygNodePropPredDataset
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import GATConv


class GAT(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers, heads):
        super().__init__()
        self.num_layers = num_layers
        self.convs = torch.nn.ModuleList()
        self.skips = torch.nn.ModuleList()
        self.convs.append(GATConv(in_channels, hidden_channels, heads))
        self.skips.append(Linear(in_channels, hidden_channels * heads))
        for _ in range(num_layers - 2):
            self.convs.append(GATConv(heads * hidden_channels, hidden_channels, heads))
            self.skips.append(Linear(hidden_channels * heads, hidden_channels * heads))
        self.convs.append(GATConv(heads * hidden_channels, out_channels, heads=6, concat=False))
        self.skips.append(Linear(hidden_channels * heads, out_channels))

    def forward(self, x, edge_index):
        for i, (conv, skip) in enumerate(zip(self.convs, self.skips)):
            x = conv(x, edge_index) + skip(x)
            if i != self.num_layers - 1:
                x = F.elu(x)
                x = F.dropout(x, p=0.5, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, loader, device):
        for i, (conv, skip) in enumerate(zip(self.convs, self.skips)):
            xs = []
            for batch in loader:
                x = x_all[batch.n_id].to(device)
                edge_index = batch.edge_index.to(device)
                x = conv(x, edge_index) + skip(x)
                if i != self.num_layers - 1:
                    x = F.elu(x)
                xs.append(x[: batch.batch_size].cpu())
            x_all = torch.cat(xs, dim=0)
        return x_all


def run(rank, world_size, dataset, split_idx, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.master_port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    data = dataset[0]
    data.y = data.y.view(-1)
    train_idx = split_idx["train"]
    train_idx = train_idx.split(train_idx.size(0) // world_size)[rank]

    train_loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=[10, 10, 10],
                                  batch_size=args.batch_size, shuffle=True,
                                  num_workers=args.num_workers, persistent_workers=True)
    if rank == 0:
        subgraph_loader = NeighborLoader(data, input_nodes=None, num_neighbors=[-1],
                                         batch_size=args.eval_batch_size, shuffle=False,
                                         num_workers=args.num_workers)
        evaluator = Evaluator(name="ogbn-products")

    torch.manual_seed(args.seed)
    model = GAT(dataset.num_features, args.hidden, dataset.num_classes,
                num_layers=3, heads=4).to(device)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        tic = time.time()
        total_loss = total_correct = total_examples = 0
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            y = batch.y[: batch.batch_size]
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            total_loss += float(loss) * y.numel()
            total_correct += int((out.argmax(dim=-1) == y).sum())
            total_examples += y.numel()

        stats = torch.tensor([total_loss, total_correct, total_examples],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        if rank == 0:
            print(f"Epoch {epoch:02d}, loss {stats[0] / stats[2]:.4f}, "
                  f"approx. train acc {stats[1] / stats[2]:.4f}, {time.time() - tic:.1f}s")

        if rank == 0 and epoch >= args.eval_start and epoch % args.eval_every == 0:
            model.eval()
            out = model.inference(data.x, subgraph_loader, device)
            y_pred = out.argmax(dim=-1, keepdim=True)
            y_true = data.y.view(-1, 1)
            val_acc = evaluator.eval({"y_true": y_true[split_idx["valid"]],
                                      "y_pred": y_pred[split_idx["valid"]]})["acc"]
            test_acc = evaluator.eval({"y_true": y_true[split_idx["test"]],
                                       "y_pred": y_pred[split_idx["test"]]})["acc"]
            print(f"Epoch {epoch:02d}, val {val_acc:.4f}, test {test_acc:.4f}")
            if val_acc > best_val:
                best_val = val_acc
                os.makedirs(args.out_dir, exist_ok=True)
                torch.save(model.module.state_dict(), osp.join(args.out_dir, "gat_best.pt"))

        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=osp.join(osp.dirname(osp.realpath(__file__)), "data"))
    parser.add_argument("--world_size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--eval_batch_size", type=int, default=1024)
    parser.add_argument("--eval_start", type=int, default=5)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--num_workers", type=int, default=6)
    parser.add_argument("--master_port", type=int, default=29531)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", default="checkpoints")
    args = parser.parse_args()

    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    split_idx = dataset.get_idx_split()
    assert args.world_size <= torch.cuda.device_count()
    print(f"Training on {args.world_size} GPUs")
    mp.spawn(run, args=(args.world_size, dataset, split_idx, args),
             nprocs=args.world_size, join=True)
