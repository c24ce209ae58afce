"""ogbl-citation2 link prediction: GraphSAGE encoder + dot-product decoder,
mini-batch training with LinkNeighborLoader on several GPUs, MRR against the
1000 official negatives per source for validation / test.

    torchrun --standalone --nproc_per_node=4 08_citation2_sage_mrr.py
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_geometric.transforms as T
from ogb.linkproppred import Evaluator, PygLinkPropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader, NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGE(torch.nn.Module):
    def __init__(self, in_channels, hidden, num_layers=3, dropout=0.0):
        super().__init__()
        self.convs = torch.nn.ModuleList()
        for i in range(num_layers):
            self.convs.append(SAGEConv(in_channels if i == 0 else hidden, hidden))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = x.relu()
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x

    @torch.no_grad()
    def inference(self, x_all, loader, device):
        for i, conv in enumerate(self.convs):
            outs = []
            for batch in loader:
                h = conv(x_all[batch.n_id].to(device), batch.edge_index.to(device))
                if i < len(self.convs) - 1:
                    h = h.relu()
                outs.append(h[: batch.batch_size].cpu())
            x_all = torch.cat(outs, dim=0)
        return x_all


@torch.no_grad()
def evaluate_mrr(model, data, infer_loader, split_edge, split, evaluator,
                 device, rank, world_size, chunk=2048):
    model.eval()
    emb = model.inference(data.x, infer_loader, device).to(device)

    src = split_edge[split]["source_node"]
    dst = split_edge[split]["target_node"]
    neg = split_edge[split]["target_node_neg"]
    # each rank scores its own contiguous block of query sources
    per = (src.numel() + world_size - 1) // world_size
    lo, hi = rank * per, min((rank + 1) * per, src.numel())

    mrr_sum, n = 0.0, 0
    for start in range(lo, hi, chunk):
        end = min(start + chunk, hi)
        s = src[start:end].to(device)
        d = dst[start:end].to(device)
        nd = neg[start:end].to(device)
        pos = (emb[s] * emb[d]).sum(-1)
        negs = (emb[s].unsqueeze(1) * emb[nd]).sum(-1)
        res = evaluator.eval({"y_pred_pos": pos, "y_pred_neg": negs})
        mrr_sum += res["mrr_list"].sum().item()
        n += end - start

    stats = torch.tensor([mrr_sum, float(n)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--num_layers", type=int, default=3)
    ap.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--eval_every", type=int, default=2)
    ap.add_argument("--ckpt", default="checkpoints/citation2_sage.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    if rank == 0:
        PygLinkPropPredDataset("ogbl-citation2", root=args.root)
    dist.barrier()
    dataset = PygLinkPropPredDataset("ogbl-citation2", root=args.root)
    split_edge = dataset.get_edge_split()
    data = T.ToUndirected()(dataset[0])
    evaluator = Evaluator(name="ogbl-citation2")

    train_src = split_edge["train"]["source_node"]
    train_dst = split_edge["train"]["target_node"]
    per = train_src.numel() // world_size
    sl = slice(rank * per, (rank + 1) * per)
    edge_label_index = torch.stack([train_src[sl], train_dst[sl]], dim=0)

    train_loader = LinkNeighborLoader(
        data,
        num_neighbors=args.fanout,
        edge_label_index=edge_label_index,
        neg_sampling="binary",
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=6,
        persistent_workers=True,
    )
    infer_loader = NeighborLoader(
        copy.copy(data), input_nodes=None, num_neighbors=[-1],
        batch_size=8192, shuffle=False, num_workers=4,
    )

    model = SAGE(data.num_features, args.hidden, args.num_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    best_valid = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for batch in train_loader:
            batch = batch.to(device)
            optimizer.zero_grad()
            h = model(batch.x, batch.edge_index)
            src, dst = batch.edge_label_index
            logits = (h[src] * h[dst]).sum(-1)
            loss = F.binary_cross_entropy_with_logits(logits, batch.edge_label)
            loss.backward()
            optimizer.step()
            tot[0] += loss.detach()
            tot[1] += 1
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {tot[0].item() / tot[1].item():.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)

        if epoch % args.eval_every == 0:
            valid_mrr = evaluate_mrr(model.module, data, infer_loader, split_edge,
                                     "valid", evaluator, device, rank, world_size)
            if rank == 0:
                print(f"  valid MRR {valid_mrr:.4f}", flush=True)
                if valid_mrr > best_valid:
                    best_valid = valid_mrr
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save(model.module.state_dict(), args.ckpt)
            dist.barrier()

    model.module.load_state_dict(torch.load(args.ckpt, map_location=device))
    test_mrr = evaluate_mrr(model.module, data, infer_loader, split_edge,
                            "test", evaluator, device, rank, world_size)
    if rank == 0:
        print(f"best valid MRR {best_valid:.4f}, test MRR {test_mrr:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
