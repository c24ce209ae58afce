"""ogbl-collab link prediction (Hits@50) with DGL, multi-GPU.

Edge mini-batches come from DGL's edge-prediction sampler with uniform
negative sampling; `use_ddp=True` makes the DGL DataLoader split the
seed edges across ranks and reshuffle them every epoch.

    torchrun --standalone --nproc_per_node=4 09_collab_dgl_linkpred.py --epochs 20
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
from dgl.dataloading import (DataLoader, MultiLayerFullNeighborSampler, NeighborSampler,
                             as_edge_prediction_sampler, negative_sampler)
from ogb.linkproppred import DglLinkPropPredDataset, Evaluator
from torch.nn.parallel import DistributedDataParallel


class SAGE(nn.Module):
    def __init__(self, in_size, hid_size, num_layers=3):
        super().__init__()
        self.hid_size = hid_size
        self.layers = nn.ModuleList([dglnn.SAGEConv(in_size, hid_size, "mean")])
        for _ in range(num_layers - 1):
            self.layers.append(dglnn.SAGEConv(hid_size, hid_size, "mean"))
        self.predictor = nn.Sequential(
            nn.Linear(hid_size, hid_size), nn.ReLU(),
            nn.Linear(hid_size, hid_size), nn.ReLU(),
            nn.Linear(hid_size, 1),
        )

    def encode(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = F.relu(h)
        return h

    def forward(self, pair_graph, neg_pair_graph, blocks, x):
        h = self.encode(blocks, x)
        pos_src, pos_dst = pair_graph.edges()
        neg_src, neg_dst = neg_pair_graph.edges()
        h_pos = self.predictor(h[pos_src] * h[pos_dst])
        h_neg = self.predictor(h[neg_src] * h[neg_dst])
        return h_pos, h_neg

    @torch.no_grad()
    def inference(self, g, device, batch_size):
        """Layer-wise full-neighbour inference; results are kept on the CPU."""
        feat = g.ndata["feat"]
        sampler = MultiLayerFullNeighborSampler(1, prefetch_node_feats=["feat"])
        loader = DataLoader(g, torch.arange(g.num_nodes()), sampler, device=device,
                            batch_size=batch_size, shuffle=False, drop_last=False,
                            num_workers=0)
        for l, layer in enumerate(self.layers):
            y = torch.empty(g.num_nodes(), self.hid_size, pin_memory=True)
            feat = feat.to(device)
            for input_nodes, output_nodes, blocks in loader:
                h = layer(blocks[0], feat[input_nodes])
                if l != len(self.layers) - 1:
                    h = F.relu(h)
                y[output_nodes] = h.cpu()
            feat = y
        return y


@torch.no_grad()
def score_edges(model, h, edges, device, batch_size=65536):
    out = []
    for chunk in torch.split(edges, batch_size):
        src, dst = chunk[:, 0], chunk[:, 1]
        out.append(model.predictor(h[src].to(device) * h[dst].to(device)).squeeze(-1).cpu())
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, g, split_edge, evaluator, device):
    model.eval()
    h = model.inference(g, device, batch_size=4096)
    results = {}
    for split in ("valid", "test"):
        pos = score_edges(model, h, split_edge[split]["edge"], device)
        neg = score_edges(model, h, split_edge[split]["edge_neg"], device)
        results[split] = evaluator.eval({"y_pred_pos": pos, "y_pred_neg": neg})["hits@50"]
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/data/ogb")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--fanout", default="15,10,5")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--eval_every", type=int, default=2)
    parser.add_argument("--ckpt_dir", default="checkpoints/collab")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # rank 0 downloads and converts; everyone else waits and then reads the cache
    if rank == 0:
        DglLinkPropPredDataset(name="ogbl-collab", root=args.root)
    dist.barrier()
    dataset = DglLinkPropPredDataset(name="ogbl-collab", root=args.root)
    g = dataset[0]
    split_edge = dataset.get_edge_split()
    g.create_formats_()

    train_eids = torch.arange(g.num_edges(), device=device)
    sampler = NeighborSampler([int(f) for f in args.fanout.split(",")],
                              prefetch_node_feats=["feat"])
    sampler = as_edge_prediction_sampler(sampler, exclude="self",
                                         negative_sampler=negative_sampler.Uniform(1))
    train_loader = DataLoader(g, train_eids, sampler, device=device,
                              batch_size=args.batch_size, shuffle=True, drop_last=False,
                              num_workers=0, use_ddp=True, use_uva=True)

    model = SAGE(g.ndata["feat"].shape[1], args.hidden).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    evaluator = Evaluator(name="ogbl-collab")

    start_epoch, best_valid = 0, 0.0
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_epoch, best_valid = state["epoch"] + 1, state["best_valid"]

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        total_loss = 0.0
        for it, (input_nodes, pair_graph, neg_pair_graph, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            pos_score, neg_score = model(pair_graph, neg_pair_graph, blocks, x)
            score = torch.cat([pos_score, neg_score])
            labels = torch.cat([torch.ones_like(pos_score), torch.zeros_like(neg_score)])
            loss = F.binary_cross_entropy_with_logits(score, labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.item()
        if rank == 0:
            print(f"epoch {epoch:02d} | loss {total_loss / (it + 1):.4f} (rank 0) | "
                  f"{time.time() - t0:.1f}s", flush=True)

        if rank == 0 and (epoch + 1) % args.eval_every == 0:
            res = evaluate(model.module, g, split_edge, evaluator, device)
            print(f"epoch {epoch:02d} | valid hits@50 {res['valid']:.4f} | "
                  f"test hits@50 {res['test']:.4f}", flush=True)
            best_valid = max(best_valid, res["valid"])
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "best_valid": best_valid}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
