#!/usr/bin/env python
"""Multi-GPU GraphSAGE on ogbn-products with DGL neighbour sampling.

The graph and features stay in (pinned) host memory of every process; each
rank samples blocks around its own share of the training seed nodes.
Full-neighbour layer-wise inference on rank 0 at the end.

    torchrun --nproc_per_node=8 04_graphsage_ogbn_products.py --epochs 20
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
import torchmetrics.functional as MF
from dgl.data import AsNodePredDataset
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP


class SAGE(nn.Module):
    def __init__(self, in_size, hid_size, out_size, num_layers=3, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.SAGEConv(in_size, hid_size, "mean"))
        for _ in range(num_layers - 2):
            self.layers.append(dglnn.SAGEConv(hid_size, hid_size, "mean"))
        self.layers.append(dglnn.SAGEConv(hid_size, out_size, "mean"))
        self.dropout = nn.Dropout(dropout)
        self.hid_size = hid_size
        self.out_size = out_size

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = F.relu(h)
                h = self.dropout(h)
        return h

    @torch.no_grad()
    def inference(self, g, device, batch_size):
        feat = g.ndata["feat"]
        sampler = dgl.dataloading.MultiLayerFullNeighborSampler(1, prefetch_node_feats=["feat"])
        loader = dgl.dataloading.DataLoader(
            g, torch.arange(g.num_nodes()).to(g.device), sampler, device=device,
            batch_size=batch_size, shuffle=False, drop_last=False, num_workers=0)
        buffer_device = torch.device("cpu")
        pin = buffer_device != device
        for l, layer in enumerate(self.layers):
            out = self.out_size if l == len(self.layers) - 1 else self.hid_size
            y = torch.empty(g.num_nodes(), out, dtype=feat.dtype,
                            device=buffer_device, pin_memory=pin)
            feat = feat.to(device)
            for input_nodes, output_nodes, blocks in loader:
                x = feat[input_nodes]
                h = layer(blocks[0], x)
                if l != len(self.layers) - 1:
                    h = F.relu(h)
                y[output_nodes[0]:output_nodes[-1] + 1] = h.to(buffer_device)
            feat = y
        return y


def evaluate(model, g, num_classes, loader):
    model.eval()
    ys, y_hats = [], []
    for input_nodes, output_nodes, blocks in loader:
        with torch.no_grad():
            x = blocks[0].srcdata["feat"]
            ys.append(blocks[-1].dstdata["label"])
            y_hats.append(model(blocks, x))
    model.train()
    return MF.accuracy(torch.cat(y_hats), torch.cat(ys), task="multiclass",
                       num_classes=num_classes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="dataset")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--fanout", default="10,10,10")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="ckpt/sage_products.pt")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    dataset = AsNodePredDataset(DglNodePropPredDataset("ogbn-products", root=args.root))
    g = dataset[0]
    g.create_formats_()
    num_classes = dataset.num_classes
    train_idx = dataset.train_idx
    val_idx = dataset.val_idx
    test_idx = dataset.test_idx

    # every rank works on its own contiguous share of seeds
    train_idx = torch.chunk(train_idx, world)[rank].to(device)
    val_idx = torch.chunk(val_idx, world)[rank].to(device)

    fanouts = [int(f) for f in args.fanout.split(",")]
    sampler = dgl.dataloading.NeighborSampler(
        fanouts, prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = dgl.dataloading.DataLoader(
        g, train_idx, sampler, device=device, batch_size=args.batch_size,
        shuffle=True, drop_last=False, num_workers=0, use_uva=True)
    val_loader = dgl.dataloading.DataLoader(
        g, val_idx, sampler, device=device, batch_size=args.batch_size,
        shuffle=False, drop_last=False, num_workers=0, use_uva=True)

    model = SAGE(g.ndata["feat"].shape[1], args.hidden, num_classes, len(fanouts)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)

    for epoch in range(args.epochs):
        t0 = time.time()
        total_loss = torch.zeros(1, device=device)
        n_batches = 0
        for it, (input_nodes, output_nodes, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"].long()
            y_hat = model(blocks, x)
            loss = F.cross_entropy(y_hat, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.detach()
            n_batches += 1

        acc = evaluate(model, g, num_classes, val_loader).to(device) / world
        dist.reduce(acc, 0)
        dist.all_reduce(total_loss)
        if rank == 0:
            print(f"epoch {epoch:03d} | loss {total_loss.item() / (n_batches * world):.4f} "
                  f"| val acc {acc.item():.4f} | {time.time() - t0:.1f}s", flush=True)

    if rank == 0:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        torch.save(model.module.state_dict(), args.out)
        pred = model.module.inference(g, device, 4096)
        pred = pred[test_idx].argmax(1)
        label = g.ndata["label"][test_idx].to(pred.device)
        test_acc = (pred == label).float().mean().item()
        print(f"test acc {test_acc:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
