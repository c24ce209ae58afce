"""GraphSAGE on Reddit, one process per GPU started with torch.multiprocessing.

The dataset is loaded once in the parent and handed to the workers (its
tensors go through shared memory), so the 232k x 602 feature matrix is not
read from disk N times.

    python 04_reddit_sage_spawn.py --epochs 20 --gpus 4
"""
import argparse
import copy
import os
import os.path as osp
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.datasets import Reddit
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels, num_layers=2):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        for _ in range(num_layers - 2):
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
        for i, conv in enumerate(self.convs):
            xs = []
            for batch in subgraph_loader:
                x = x_all[batch.n_id.to(x_all.device)].to(device)
                x = conv(x, batch.edge_index.to(device))
                if i < len(self.convs) - 1:
                    x = x.relu_()
                xs.append(x[:batch.batch_size].cpu())
            x_all = torch.cat(xs, dim=0)
        return x_all


def run(rank, world_size, dataset, args):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)

    data = dataset[0]
    data = data.to(rank, "x", "y")  # features and labels live on this GPU

    # equal-sized, disjoint chunks of the training seeds (remainder dropped)
    train_idx = data.train_mask.nonzero(as_tuple=False).view(-1)
    train_idx = train_idx.split(train_idx.size(0) // world_size)[rank]

    train_loader = NeighborLoader(
        data,
        input_nodes=train_idx,
        num_neighbors=[25, 10],
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=4,
        persistent_workers=True,
    )

    if rank == 0:
        subgraph_loader = NeighborLoader(
            copy.copy(data), input_nodes=None, num_neighbors=[-1],
            batch_size=2048, shuffle=False, num_workers=4,
        )
        # layer-wise inference only needs the graph structure
        del subgraph_loader.data.x, subgraph_loader.data.y
        subgraph_loader.data.num_nodes = data.num_nodes
        subgraph_loader.data.n_id = torch.arange(data.num_nodes)
        os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(12345)
    model = SAGE(dataset.num_features, args.hidden, dataset.num_classes).to(rank)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_val = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        total = torch.zeros(2, device=rank)
        for batch in train_loader:
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index.to(rank))[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            optimizer.step()
            total[0] += loss.detach()
            total[1] += 1
        dist.all_reduce(total)

        if rank == 0:
            print(f"Epoch {epoch:02d}, loss {(total[0] / total[1]).item():.4f}, "
                  f"{time.time() - t0:.1f}s", flush=True)

        if rank == 0 and epoch % 5 == 0:
            model.eval()
            with torch.no_grad():
                out = model.module.inference(data.x, rank, subgraph_loader)
            pred = out.argmax(dim=-1)
            y = data.y.cpu()
            accs = [int((pred[m] == y[m]).sum()) / int(m.sum())
                    for m in (data.train_mask, data.val_mask, data.test_mask)]
            print(f"  train {accs[0]:.4f}, val {accs[1]:.4f}, test {accs[2]:.4f}")
            if accs[1] > best_val:
                best_val = accs[1]
                torch.save(model.module.state_dict(), osp.join(args.out, "sage_reddit.pt"))

        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=osp.join(osp.dirname(osp.realpath(__file__)), "data", "Reddit"))
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--port", type=int, default=12355)
    parser.add_argument("--out", default="checkpoints")
    args = parser.parse_args()

    dataset = Reddit(args.root)
    world_size = min(args.gpus, torch.cuda.device_count())
    print(f"Let's use {world_size} GPUs!")
    mp.spawn(run, args=(world_size, dataset, args), nprocs=world_size, join=True)
