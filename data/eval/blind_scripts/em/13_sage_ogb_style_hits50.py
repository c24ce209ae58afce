"""
Full-graph GraphSAGE + MLP link predictor on the seller-collaboration graph
(same format and metric as ogbl-collab, evaluated with the OGB Evaluator).

split_edge = {"train": {"edge"}, "valid": {"edge", "edge_neg"}, "test": {"edge", "edge_neg"}}

    torchrun --nproc_per_node=4 sage_seller_collab.py --root /mnt/graphs/seller_collab
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from ogb.linkproppred import Evaluator
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import SAGEConv


class SAGE(nn.Module):
    def __init__(self, in_channels, hidden, num_layers, dropout):
        super().__init__()
        self.convs = nn.ModuleList([SAGEConv(in_channels, hidden)])
        for _ in range(num_layers - 1):
            self.convs.append(SAGEConv(hidden, hidden))
        self.dropout = dropout

    def forward(self, x, adj_t):
        for conv in self.convs[:-1]:
            x = F.dropout(F.relu(conv(x, adj_t)), p=self.dropout, training=self.training)
        return self.convs[-1](x, adj_t)


class Predictor(nn.Module):
    def __init__(self, hidden, num_layers, dropout):
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(num_layers - 1)])
        self.out = nn.Linear(hidden, 1)
        self.dropout = dropout

    def forward(self, hi, hj):
        x = hi * hj
        for lin in self.lins:
            x = F.dropout(F.relu(lin(x)), p=self.dropout, training=self.training)
        return self.out(x).view(-1)


class LinkModel(nn.Module):
    def __init__(self, in_channels, hidden, num_layers, dropout):
        super().__init__()
        self.encoder = SAGE(in_channels, hidden, num_layers, dropout)
        self.predictor = Predictor(hidden, 3, dropout)

    def forward(self, x, adj_t, pos, neg):
        h = self.encoder(x, adj_t)
        return self.predictor(h[pos[0]], h[pos[1]]), self.predictor(h[neg[0]], h[neg[1]])


@torch.no_grad()
def score_edges(net, h, edges, batch=65536):
    return torch.cat([net.predictor(h[e[0]], h[e[1]]).sigmoid() for e in edges.split(batch, dim=1)])


@torch.no_grad()
def evaluate(model, data, split_edge, split, evaluator, rank, world, device):
    net = model.module
    net.eval()
    h = net.encoder(data.x, data.adj_t)
    pos = split_edge[split]["edge"].t().to(device).tensor_split(world, dim=1)[rank]
    neg = split_edge[split]["edge_neg"].t().to(device).tensor_split(world, dim=1)[rank]
    pos_s, neg_s = score_edges(net, h, pos), score_edges(net, h, neg)

    pos_all = [torch.empty_like(pos_s) for _ in range(world)]
    neg_all = [torch.empty_like(neg_s) for _ in range(world)]
    dist.all_gather(pos_all, pos_s)
    dist.all_gather(neg_all, neg_s)
    net.train()
    if rank != 0:
        return None
    out = {}
    for k in (10, 50, 100):
        evaluator.K = k
        out[f"hits@{k}"] = evaluator.eval({"y_pred_pos": torch.cat(pos_all).cpu(),
                                           "y_pred_neg": torch.cat(neg_all).cpu()})[f"hits@{k}"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="/mnt/experiments/seller_collab")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=64 * 1024, help="global")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--eval-steps", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    data = torch.load(os.path.join(args.root, "graph.pt"))
    split_edge = torch.load(os.path.join(args.root, "split_edge.pt"))
    data = T.ToSparseTensor()(data)
    data = data.to(device)
    train_pos = split_edge["train"]["edge"].to(device)

    torch.manual_seed(0)
    model = LinkModel(data.num_features, args.hidden, args.num_layers, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    evaluator = Evaluator(name="ogbl-collab")

    idx = range(train_pos.size(0))
    sampler = DistributedSampler(idx, shuffle=True)
    loader = DataLoader(idx, batch_size=args.batch_size // world, sampler=sampler)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        t0 = time.time()
        total = torch.zeros(2, device=device)
        for perm in loader:
            perm = perm.to(device)
            pos = train_pos[perm].t()
            neg = torch.randint(0, data.num_nodes, pos.size(), dtype=torch.long, device=device)
            pos_out, neg_out = model(data.x, data.adj_t, pos, neg)
            loss = -F.logsigmoid(pos_out).mean() - F.logsigmoid(-neg_out).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * pos.size(1), torch.tensor(pos.size(1), device=device).float()])
        dist.all_reduce(total)

        if epoch % args.eval_steps == 0:
            res = evaluate(model, data, split_edge, "valid", evaluator, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch:03d} loss {(total[0] / total[1]).item():.4f} valid {res} "
                      f"({time.time() - t0:.1f}s)", flush=True)
                if res["hits@50"] > best:
                    best = res["hits@50"]
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    res = evaluate(model, data, split_edge, "test", evaluator, rank, world, device)
    if rank == 0:
        print(f"test {res} (best valid hits@50 {best:.4f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
