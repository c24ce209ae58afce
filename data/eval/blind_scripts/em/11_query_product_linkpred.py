"""Search query -> product click graph: heterogeneous GraphSAGE link prediction.

Queries and products both carry 384-d sentence embeddings. The model is used to
propose products for long-tail queries that have few clicks.

    torchrun --nproc_per_node=8 query_product_sage.py --data /mnt/graphs/qp/2024-06/hetero.pt
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import HeteroConv, SAGEConv

EDGE = ("query", "clicks", "product")
REV = ("product", "rev_clicks", "query")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="/mnt/experiments/query_product")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--bs", type=int, default=2048, help="per-GPU batch; lr tuned for 8 GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--neg-ratio", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--hits-k", type=int, default=100)
    return p.parse_args()


class QPModel(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.proj = nn.ModuleDict({"query": nn.Linear(384, hidden), "product": nn.Linear(384, hidden)})
        self.conv1 = HeteroConv({EDGE: SAGEConv(hidden, hidden), REV: SAGEConv(hidden, hidden)}, aggr="sum")
        self.conv2 = HeteroConv({EDGE: SAGEConv(hidden, hidden), REV: SAGEConv(hidden, hidden)}, aggr="sum")

    def forward(self, x_dict, edge_index_dict, edge_label_index):
        h = {k: self.proj[k](x) for k, x in x_dict.items()}
        h = {k: v.relu() for k, v in self.conv1(h, edge_index_dict).items()}
        h = self.conv2(h, edge_index_dict)
        return (h["query"][edge_label_index[0]] * h["product"][edge_label_index[1]]).sum(-1)


def loader_for(data, eli, label, args, train):
    return LinkNeighborLoader(
        data,
        num_neighbors={EDGE: [10, 5], REV: [10, 5]},
        edge_label_index=(EDGE, eli),
        edge_label=label,
        neg_sampling_ratio=args.neg_ratio if train else None,
        batch_size=args.bs if train else 8192,
        shuffle=train,
        num_workers=args.workers,
        persistent_workers=train,
    )


@torch.no_grad()
def evaluate(model, data, args, rank, world, device):
    model.eval()
    eli = data[EDGE].edge_label_index[:, rank::world]
    lbl = data[EDGE].edge_label[rank::world]
    pos, neg = [], []
    for b in loader_for(data, eli, lbl, args, train=False):
        b = b.to(device)
        s = model.module(b.x_dict, b.edge_index_dict, b[EDGE].edge_label_index)
        pos.append(s[b[EDGE].edge_label == 1])
        neg.append(s[b[EDGE].edge_label == 0])
    pos, neg = torch.cat(pos), torch.cat(neg)
    k = args.hits_k
    top = neg.topk(k).values
    gathered = [torch.zeros_like(top) for _ in range(world)]
    dist.all_gather(gathered, top)
    threshold = torch.cat(gathered).topk(k).values[-1]
    counts = torch.tensor([(pos > threshold).sum().item(), pos.numel(),
                           (neg.sigmoid() < 0.5).sum().item() + (pos.sigmoid() >= 0.5).sum().item(),
                           pos.numel() + neg.numel()], dtype=torch.float, device=device)
    dist.all_reduce(counts)
    model.train()
    return {f"hits@{k}": (counts[0] / counts[1]).item(), "acc": (counts[2] / counts[3]).item()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(12345)

    # split was made offline with RandomLinkSplit(edge_types=EDGE, rev_edge_types=REV)
    train_data, val_data, test_data = torch.load(args.data)
    for d in (train_data, val_data, test_data):
        d["query"].x = d["query"].x.float()
        d["product"].x = d["product"].x.float()

    train_loader = loader_for(train_data, train_data[EDGE].edge_label_index,
                              train_data[EDGE].edge_label, args, train=True)

    model = QPModel(args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} steps/epoch={len(train_loader)} "
              f"val_edges={val_data[EDGE].edge_label.numel()}", flush=True)

    best, log = 0.0, []
    for epoch in range(args.epochs):
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for step, b in enumerate(train_loader):
            b = b.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(b.x_dict, b.edge_index_dict, b[EDGE].edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logits.float(), b[EDGE].edge_label.float())
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and step % 500 == 0:
                print(f"  epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(tot)

        metrics = evaluate(model, val_data, args, rank, world, device)
        if rank == 0:
            metrics.update(epoch=epoch, loss=(tot[0] / tot[1]).item(), secs=round(time.time() - t0))
            log.append(metrics)
            print(json.dumps(metrics), flush=True)
            if metrics[f"hits@{args.hits_k}"] > best:
                best = metrics[f"hits@{args.hits_k}"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))

    dist.barrier()
    model.module.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    test_metrics = evaluate(model, test_data, args, rank, world, device)
    if rank == 0:
        print("test", json.dumps(test_metrics))
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump({"epochs": log, "test": test_metrics}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
