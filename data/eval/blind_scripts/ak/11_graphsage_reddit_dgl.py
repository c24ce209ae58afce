#!/usr/bin/env python
"""GraphSAGE on Reddit (232k nodes, 114M edges) with DGL, launched by torchrun.

Sampling on GPU through UVA: the graph and features stay pinned in host memory.
Every few epochs rank 0 runs exact layer-wise inference over the whole graph for
validation/test accuracy; the other ranks wait at the barrier.

    torchrun --nproc_per_node=4 11_graphsage_reddit_dgl.py --epochs 30 --eval-every 5
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
from dgl.data import RedditDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


class SAGE(nn.Module):
    def __init__(self, in_feats, n_hidden, n_classes, n_layers, dropout):
        super().__init__()
        self.n_hidden, self.n_classes = n_hidden, n_classes
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.SAGEConv(in_feats, n_hidden, "mean"))
        for _ in range(1, n_layers - 1):
            self.layers.append(dglnn.SAGEConv(n_hidden, n_hidden, "mean"))
        self.layers.append(dglnn.SAGEConv(n_hidden, n_classes, "mean"))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h

    @torch.no_grad()
    def inference(self, g, x, device, batch_size):
        """Layer-wise inference with full neighbourhoods; x lives on the CPU."""
        sampler = dgl.dataloading.MultiLayerFullNeighborSampler(1)
        loader = dgl.dataloading.DataLoader(
            g, torch.arange(g.num_nodes(), device=device), sampler, device=device,
            batch_size=batch_size, shuffle=False, drop_last=False, num_workers=0,
            use_uva=True)
        for l, layer in enumerate(self.layers):
            out = self.n_classes if l == len(self.layers) - 1 else self.n_hidden
            y = torch.zeros(g.num_nodes(), out)
            for input_nodes, output_nodes, blocks in loader:
                h = layer(blocks[0], x[input_nodes.cpu()].to(device))
                if l != len(self.layers) - 1:
                    h = F.relu(h)
                y[output_nodes.cpu()] = h.cpu()
            x = y
        return y


def accuracy(logits, labels):
    return (logits.argmax(1) == labels).float().mean().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--fanout", default="25,10")
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--out", default="runs/sage_reddit")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    data = RedditDataset(self_loop=True)
    g = data[0]
    g.create_formats_()
    feats = g.ndata.pop("feat")
    labels = g.ndata.pop("label")
    train_nid = g.ndata["train_mask"].nonzero().squeeze(1)
    val_nid = g.ndata["val_mask"].nonzero().squeeze(1)
    test_nid = g.ndata["test_mask"].nonzero().squeeze(1)
    g.ndata["feat"] = feats
    g.ndata["label"] = labels

    fanouts = [int(f) for f in args.fanout.split(",")]
    sampler = dgl.dataloading.NeighborSampler(
        fanouts, prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = dgl.dataloading.DataLoader(
        g, train_nid.to(device), sampler, device=device, batch_size=args.batch_size,
        shuffle=True, drop_last=False, num_workers=0, use_ddp=True, use_uva=True)

    model = SAGE(feats.shape[1], args.hidden, data.num_classes, args.layers, args.dropout)
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    writer = SummaryWriter(args.out) if rank == 0 else None
    best_val, best_test = 0.0, 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for step, (input_nodes, seeds, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0 and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + step)
        if rank == 0:
            print(f"epoch {epoch} time {time.time() - t0:.1f}s loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            if rank == 0:
                model.eval()
                pred = model.inference(g, g.ndata["feat"], device, 10000)
                val_acc = accuracy(pred[val_nid], labels[val_nid])
                test_acc = accuracy(pred[test_nid], labels[test_nid])
                writer.add_scalar("val/acc", val_acc, epoch)
                writer.add_scalar("test/acc", test_acc, epoch)
                if val_acc > best_val:
                    best_val, best_test = val_acc, test_acc
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                print(f"  val {val_acc:.4f} test {test_acc:.4f} "
                      f"(best val {best_val:.4f} / test {best_test:.4f})", flush=True)
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
