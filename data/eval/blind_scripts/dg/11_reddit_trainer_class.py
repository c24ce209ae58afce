"""Reddit node classification (GraphSAGE, 3 layers) with a small Trainer class.

    torchrun --standalone --nproc_per_node=4 11_reddit_trainer_class.py --epochs 30
"""
import argparse
import copy
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.datasets import Reddit
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv

logger = logging.getLogger(__name__)


class GraphSAGE(torch.nn.Module):
    def __init__(self, in_dim, hidden_dim, out_dim, num_layers=3, dropout=0.5):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        for a, b in zip(dims[:-1], dims[1:]):
            self.convs.append(SAGEConv(a, b))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i != len(self.convs) - 1:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, subgraph_loader, device):
        for i, conv in enumerate(self.convs):
            chunks = []
            for batch in subgraph_loader:
                x = x_all[batch.n_id].to(device)
                x = conv(x, batch.edge_index.to(device))
                if i != len(self.convs) - 1:
                    x = F.relu(x)
                chunks.append(x[: batch.batch_size].cpu())
            x_all = torch.cat(chunks, 0)
        return x_all


class Trainer:
    def __init__(self, args, data, num_features, num_classes):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.data = data

        train_idx = data.train_mask.nonzero().view(-1)
        per_rank = train_idx.numel() // self.world_size
        self.train_idx = train_idx[self.rank * per_rank:(self.rank + 1) * per_rank]
        self.train_loader = NeighborLoader(
            data, input_nodes=self.train_idx, num_neighbors=[25, 15, 10],
            batch_size=args.batch_size, shuffle=True, drop_last=True,
            num_workers=4, persistent_workers=True,
        )
        self.subgraph_loader = None
        if self.rank == 0:
            self.subgraph_loader = NeighborLoader(
                copy.copy(data), input_nodes=None, num_neighbors=[-1],
                batch_size=2048, shuffle=False, num_workers=4,
            )

        model = GraphSAGE(num_features, args.hidden, num_classes,
                          num_layers=3, dropout=args.dropout).to(self.device)
        self.model = DistributedDataParallel(model, device_ids=[self.local_rank])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.best_val = 0.0

    def train_epoch(self):
        self.model.train()
        stats = torch.zeros(2, device=self.device)
        for batch in self.train_loader:
            batch = batch.to(self.device)
            self.optimizer.zero_grad()
            out = self.model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            self.optimizer.step()
            stats[0] += loss.detach()
            stats[1] += 1
        dist.all_reduce(stats)
        return (stats[0] / stats[1]).item()

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        out = self.model.inference(self.data.x, self.subgraph_loader, self.device)
        pred = out.argmax(dim=-1)
        accs = {}
        for name in ("train", "val", "test"):
            mask = self.data[f"{name}_mask"]
            accs[name] = (pred[mask] == self.data.y[mask]).float().mean().item()
        return accs

    def save(self, path):
        torch.save({"model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "best_val": self.best_val}, path)

    def fit(self):
        for epoch in range(1, self.args.epochs + 1):
            t0 = time.time()
            loss = self.train_epoch()
            if self.rank == 0:
                logger.info("epoch %d loss %.4f (%.1fs)", epoch, loss, time.time() - t0)
                if epoch % self.args.eval_every == 0:
                    accs = self.evaluate()
                    logger.info("  train %.4f val %.4f test %.4f",
                                accs["train"], accs["val"], accs["test"])
                    if accs["val"] > self.best_val:
                        self.best_val = accs["val"]
                        self.save(os.path.join(self.args.out_dir, "best.pt"))
            dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/Reddit")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out_dir", default="outputs/reddit_sage")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    if rank == 0:
        Reddit(args.root)
        os.makedirs(args.out_dir, exist_ok=True)
    dist.barrier()
    dataset = Reddit(args.root)
    data = dataset[0]

    trainer = Trainer(args, data, dataset.num_features, dataset.num_classes)
    trainer.fit()
    if rank == 0:
        logger.info("best val acc %.4f", trainer.best_val)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
