"""Link prediction on ogbl-collab: GraphSAGE encoder + MLP edge decoder,
mini-batch training with LinkNeighborLoader on every GPU.

    torchrun --nproc_per_node=4 18_collab_linkpred.py --root data/ogb --epochs 100
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.linkproppred import Evaluator, PygLinkPropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv
from torch_geometric.utils import to_undirected


class Encoder(nn.Module):
    def __init__(self, in_dim, hid, layers=3, dropout=0.2):
        super().__init__()
        self.convs = nn.ModuleList([SAGEConv(in_dim, hid)] +
                                   [SAGEConv(hid, hid) for _ in range(layers - 1)])
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.dropout(F.relu(x), self.dropout, self.training)
        return x


class EdgeDecoder(nn.Module):
    def __init__(self, hid, layers=3, dropout=0.2):
        super().__init__()
        dims = [hid] * layers + [1]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = dropout

    def forward(self, z_src, z_dst):
        h = z_src * z_dst
        for lin in self.lins[:-1]:
            h = F.dropout(F.relu(lin(h)), self.dropout, self.training)
        return self.lins[-1](h).squeeze(-1)


class LinkModel(nn.Module):
    def __init__(self, in_dim, hid):
        super().__init__()
        self.encoder = Encoder(in_dim, hid)
        self.decoder = EdgeDecoder(hid)

    def forward(self, x, edge_index, edge_label_index):
        z = self.encoder(x, edge_index)
        return self.decoder(z[edge_label_index[0]], z[edge_label_index[1]])


@torch.no_grad()
def full_graph_eval(model, data, split_edge, evaluator, device, batch=65536):
    model.eval()
    z = model.encoder(data.x.to(device), data.edge_index.to(device))

    def score(edges):
        out = []
        for perm in torch.split(torch.arange(edges.size(0)), batch):
            e = edges[perm].t().to(device)
            out.append(torch.sigmoid(model.decoder(z[e[0]], z[e[1]])).cpu())
        return torch.cat(out)

    results = {}
    for split in ("valid", "test"):
        pos = score(split_edge[split]["edge"])
        neg = score(split_edge[split]["edge_neg"])
        results[split] = evaluator.eval({"y_pred_pos": pos, "y_pred_neg": neg})["hits@50"]
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/ogb")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--out", default="runs/collab")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        PygLinkPropPredDataset("ogbl-collab", root=args.root)
    dist.barrier()
    dataset = PygLinkPropPredDataset("ogbl-collab", root=args.root)
    data = dataset[0]
    split_edge = dataset.get_edge_split()
    data.edge_index = to_undirected(data.edge_index, num_nodes=data.num_nodes)

    # positive training edges are split evenly over ranks
    pos_train = split_edge["train"]["edge"]
    per_rank = pos_train.size(0) // world
    my_pos = pos_train[rank * per_rank:(rank + 1) * per_rank].t()

    loader = LinkNeighborLoader(data, num_neighbors=args.fanout, edge_label_index=my_pos,
                                neg_sampling_ratio=1.0, batch_size=args.batch_size,
                                shuffle=True, drop_last=True, num_workers=4,
                                persistent_workers=True)

    torch.manual_seed(0)
    model = DDP(LinkModel(data.num_features, args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    evaluator = Evaluator(name="ogbl-collab")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_valid = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for batch in loader:
            batch = batch.to(device)
            logits = model(batch.x, batch.edge_index, batch.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach() * logits.numel(),
                                torch.tensor(float(logits.numel()), device=device)])
        dist.all_reduce(agg)

        if rank == 0:
            msg = f"epoch {epoch:03d} loss {(agg[0] / agg[1]).item():.4f} ({time.time() - t0:.1f}s)"
            if epoch % args.eval_every == 0:
                res = full_graph_eval(model, data, split_edge, evaluator, device)
                msg += f" | hits@50 valid {res['valid']:.4f} test {res['test']:.4f}"
                if res["valid"] > best_valid:
                    best_valid = res["valid"]
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, **res},
                               os.path.join(args.out, "best.pt"))
            print(msg, flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
