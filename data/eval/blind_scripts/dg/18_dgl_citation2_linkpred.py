"""Link prediction on ogbl-citation2 with DGL: GraphSAGE encoder + MLP scorer,
edge mini-batches with uniform negative sampling, multi-GPU DDP.

Validation / test MRR use the official 1000 negatives per query; the queries
are split across ranks and the reciprocal-rank sums are all-reduced.

    torchrun --standalone --nproc_per_node=4 18_dgl_citation2_linkpred.py
"""
import argparse
import os
import time

import dgl
import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dgl.dataloading import (DataLoader, MultiLayerFullNeighborSampler,
                             NeighborSampler, as_edge_prediction_sampler,
                             negative_sampler)
from ogb.linkproppred import DglLinkPropPredDataset, Evaluator
from torch.nn.parallel import DistributedDataParallel as DDP


class LinkModel(nn.Module):
    def __init__(self, in_size, hid_size, num_layers=3):
        super().__init__()
        self.layers = nn.ModuleList(
            dglnn.SAGEConv(in_size if i == 0 else hid_size, hid_size, "mean")
            for i in range(num_layers)
        )
        self.predictor = nn.Sequential(
            nn.Linear(hid_size, hid_size), nn.ReLU(),
            nn.Linear(hid_size, hid_size), nn.ReLU(),
            nn.Linear(hid_size, 1),
        )
        self.hid_size = hid_size

    def encode(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = F.relu(h)
        return h

    def score(self, h_src, h_dst):
        return self.predictor(h_src * h_dst).squeeze(-1)

    def forward(self, blocks, x, pos_graph, neg_graph):
        h = self.encode(blocks, x)
        ps, pd = pos_graph.edges()
        ns, nd = neg_graph.edges()
        return self.score(h[ps], h[pd]), self.score(h[ns], h[nd])

    @torch.no_grad()
    def inference(self, g, device, batch_size):
        """Full-neighbour layer-wise embeddings for all nodes (this process only)."""
        feat = g.ndata["feat"]
        sampler = MultiLayerFullNeighborSampler(1)
        loader = DataLoader(g, torch.arange(g.num_nodes(), device=device), sampler,
                            device=device, batch_size=batch_size, shuffle=False,
                            drop_last=False, num_workers=0, use_uva=True)
        for l, layer in enumerate(self.layers):
            y = torch.empty(g.num_nodes(), self.hid_size, device="cpu", pin_memory=True)
            feat = feat.to(device)
            for input_nodes, output_nodes, blocks in loader:
                h = layer(blocks[0], feat[input_nodes])
                if l != len(self.layers) - 1:
                    h = F.relu(h)
                y[output_nodes.cpu()] = h.cpu()
            feat = y
        return y


@torch.no_grad()
def evaluate_mrr(model, g, split, evaluator, device, rank, world_size, bs=256):
    model.eval()
    emb = model.inference(g, device, 8192).to(device)
    src, dst, neg = split["source_node"], split["target_node"], split["target_node_neg"]
    mine = torch.arange(src.numel()).tensor_split(world_size)[rank]
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for chunk in mine.split(bs):
        s, d, n = src[chunk].to(device), dst[chunk].to(device), neg[chunk].to(device)
        pos = model.score(emb[s], emb[d])
        negs = model.score(emb[s].unsqueeze(1).expand_as(emb[n]), emb[n])
        rr = evaluator.eval({"y_pred_pos": pos, "y_pred_neg": negs})["mrr_list"]
        stats[0] += rr.sum()
        stats[1] += rr.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--fanout", default="15,10,5")
    ap.add_argument("--max_steps_per_epoch", type=int, default=2000)
    ap.add_argument("--ckpt", default="checkpoints/citation2_dgl.pt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        DglLinkPropPredDataset("ogbl-citation2", root=args.root)
        os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
    dist.barrier()
    dataset = DglLinkPropPredDataset("ogbl-citation2", root=args.root)
    g = dataset[0]
    split_edge = dataset.get_edge_split()
    evaluator = Evaluator("ogbl-citation2")

    E = g.num_edges()
    g = dgl.add_reverse_edges(g, copy_ndata=True)
    g.create_formats_()
    # edge i and edge i + E are each other's reverse
    reverse_eids = torch.cat([torch.arange(E, 2 * E), torch.arange(0, E)])
    seed_edges = torch.arange(E).to(device)

    sampler = NeighborSampler([int(f) for f in args.fanout.split(",")],
                              prefetch_node_feats=["feat"])
    sampler = as_edge_prediction_sampler(
        sampler, exclude="reverse_id", reverse_eids=reverse_eids,
        negative_sampler=negative_sampler.Uniform(1),
    )
    train_loader = DataLoader(g, seed_edges, sampler, device=device,
                              batch_size=args.batch_size, shuffle=True, drop_last=False,
                              num_workers=0, use_ddp=True, use_uva=True)

    model = LinkModel(g.ndata["feat"].shape[1], args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        # the same cap on every rank: each rank has len(train_loader) >= cap steps
        n_steps = min(args.max_steps_per_epoch, len(train_loader))
        for step, (_, pos_graph, neg_graph, blocks) in enumerate(train_loader):
            if step == n_steps:
                break
            x = blocks[0].srcdata["feat"]
            pos, neg = model(blocks, x, pos_graph, neg_graph)
            score = torch.cat([pos, neg])
            label = torch.cat([torch.ones_like(pos), torch.zeros_like(neg)])
            loss = F.binary_cross_entropy_with_logits(score, label)
            opt.zero_grad()
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(agg)

        valid_mrr = evaluate_mrr(model.module, g, split_edge["valid"], evaluator,
                                 device, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} loss {(agg[0] / agg[1]).item():.4f} "
                  f"valid MRR {valid_mrr:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if valid_mrr > best:
                best = valid_mrr
                torch.save(model.module.state_dict(), args.ckpt)
        dist.barrier()

    model.module.load_state_dict(torch.load(args.ckpt, map_location=device))
    test_mrr = evaluate_mrr(model.module, g, split_edge["test"], evaluator,
                            device, rank, world_size)
    if rank == 0:
        print(f"best valid MRR {best:.4f}, test MRR {test_mrr:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
