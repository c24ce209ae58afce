"""
GraphSAGE node classification on ogbn-arxiv, mini-batch neighbour sampling,
one process per GPU started with torch.multiprocessing.spawn.

    python 19_arxiv_graphsage_spawn.py            # all visible GPUs
    python 19_arxiv_graphsage_spawn.py --gpus 2 --epochs 50
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch_geometric.transforms as T
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
                x = self.norms[i](x).relu()
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


@torch.no_grad()
def full_batch_eval(model, data, split_idx, evaluator, device):
    model.eval()
    out = model(data.x.to(device), data.edge_index.to(device))
    y_pred = out.argmax(dim=-1, keepdim=True).cpu()
    res = {}
    for key in ("train", "valid", "test"):
        idx = split_idx[key]
        res[key] = evaluator.eval({"y_true": data.y[idx], "y_pred": y_pred[idx]})["acc"]
    return res


def run(rank, cfg):
    world_size = cfg["world_size"]
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(cfg["port"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg["seed"])

    dataset = PygNodePropPredDataset("ogbn-arxiv", root=cfg["root"], transform=T.ToUndirected())
    data = dataset[0]
    data.y = data.y.view(-1)
    split_idx = dataset.get_idx_split()
    evaluator = Evaluator("ogbn-arxiv")

    train_idx = split_idx["train"]
    train_idx = train_idx[torch.randperm(train_idx.numel(), generator=torch.Generator().manual_seed(cfg["seed"]))]
    train_idx = train_idx.split(train_idx.size(0) // world_size)[rank]

    loader = NeighborLoader(data, input_nodes=train_idx, num_neighbors=[15, 10, 5],
                            batch_size=cfg["batch_size"], shuffle=True, drop_last=True,
                            num_workers=4, persistent_workers=True)

    model = SAGE(dataset.num_features, cfg["hidden"], dataset.num_classes, cfg["layers"], cfg["dropout"]).to(device)
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"] * world_size)

    best_val, best_test = 0.0, 0.0
    for epoch in range(1, cfg["epochs"] + 1):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[:batch.batch_size]
            loss = F.cross_entropy(out, batch.y[:batch.batch_size])
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        if rank == 0 and epoch % cfg["eval_every"] == 0:
            res = full_batch_eval(model.module, data, split_idx, evaluator, device)
            if res["valid"] > best_val:
                best_val, best_test = res["valid"], res["test"]
                torch.save(model.module.state_dict(), cfg["ckpt"])
            print(f"Epoch {epoch:03d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"train {res['train']:.4f} valid {res['valid']:.4f} test {res['test']:.4f} "
                  f"({time.time() - t0:.1f}s)")
        dist.barrier()

    if rank == 0:
        print(f"best valid {best_val:.4f} -> test {best_test:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="dataset")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval_every", type=int, default=1)
    parser.add_argument("--ckpt", default="sage_arxiv.pt")
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # download + process once in the parent process
    PygNodePropPredDataset("ogbn-arxiv", root=args.root)

    cfg = vars(args)
    cfg["world_size"] = args.gpus
    print(f"Let's use {args.gpus} GPUs!")
    mp.spawn(run, args=(cfg), nprocs=args.gpus, join=True)
