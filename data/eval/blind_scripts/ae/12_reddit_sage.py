"""GraphSAGE on Reddit with mini-batch training on every GPU and exact layer-wise
inference on rank 0 (adapted from the PyG multi-GPU example).

    python 12_reddit_sage.py --root data/Reddit --epochs 20
"""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.datasets import Reddit
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv
from tqdm import tqdm


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers=2):
        super().__init__()
        self.num_layers = num_layers
        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(self.num_layers - 2):
            self.convs.append(SAGEConv(hidden_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = x.relu_()
                x = F.dropout(x, p=0.5, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, device, subgraph_loader):
        pbar = tqdm(total=len(subgraph_loader) * len(self.convs))
        pbar.set_description("Evaluating")
        for i, conv in enumerate(self.convs):
            xs = []
            for batch in subgraph_loader:
                x = x_all[batch.node_id.to(x_all.device)].to(device)
                x = conv(x, batch.edge_index.to(device))
                x = x[:batch.batch_size]
                if i < len(self.convs) - 1:
                    x = x.relu_()
                xs.append(x.cpu())
                pbar.update(1)
            x_all = torch.cat(xs, dim=0)
        pbar.close()
        return x_all


def run(rank, world_size, dataset, args):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    torch.cuda.set_device(rank)
    # rank 0 runs full-graph inference while the others wait at the barrier
    dist.init_process_group("nccl", rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=60))

    data = dataset[0]
    train_idx = data.train_mask.nonzero(as_tuple=False).view(-1)
    train_idx = train_idx.split(train_idx.size(0) // world_size)[rank]

    kwargs = dict(batch_size=args.batch_size, num_workers=4, persistent_workers=True)
    train_loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=[25, 10],
                                  shuffle=True, drop_last=True, **kwargs)

    if rank == 0:
        subgraph_loader = NeighborLoader(data.clone(), input_nodes=None, num_neighbors=[-1],
                                         shuffle=False, batch_size=4096, num_workers=4)
        # no need to keep features / labels inside the loader copy
        del subgraph_loader.data.x, subgraph_loader.data.y
        subgraph_loader.data.node_id = torch.arange(data.num_nodes)

    torch.manual_seed(12345)
    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes).to(rank)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        total = torch.zeros(2, device=rank)
        for batch in train_loader:
            batch = batch.to(rank)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * batch.batch_size,
                                  torch.tensor(float(batch.batch_size), device=rank)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"Epoch: {epoch:03d}, Loss: {(total[0] / total[1]).item():.4f}", flush=True)

        if rank == 0 and epoch % args.eval_every == 0:
            model.eval()
            out = model.module.inference(data.x, rank, subgraph_loader)
            res = out.argmax(dim=-1) == data.y
            train_acc = int(res[data.train_mask].sum()) / int(data.train_mask.sum())
            val_acc = int(res[data.val_mask].sum()) / int(data.val_mask.sum())
            test_acc = int(res[data.test_mask].sum()) / int(data.test_mask.sum())
            print(f"Train: {train_acc:.4f}, Val: {val_acc:.4f}, Test: {test_acc:.4f}", flush=True)
            if val_acc > best_val:
                best_val = val_acc
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "sage_reddit.pt"))

        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/Reddit")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--out", default="checkpoints")
    args = parser.parse_args()

    dataset = Reddit(args.root)
    world_size = torch.cuda.device_count()
    print(f"Let's use {world_size} GPUs!")
    mp.spawn(run, args=(world_size, dataset, args), nprocs=world_size, join=True)
