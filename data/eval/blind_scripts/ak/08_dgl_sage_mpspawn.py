#!/usr/bin/env python
"""GraphSAGE node classification on ogbn-arxiv / ogbn-products, one process per GPU.

Follows the layout of DGL's multi-GPU example: the graph is loaded once in the
parent, its sparse formats are materialised before the workers are spawned, and
each worker trains on its share of the seeds (DataLoader(use_ddp=True)).

    python 08_dgl_sage_mpspawn.py --gpu 0,1,2,3 --dataset ogbn-products
"""
import argparse
import os
import time

import dgl
import dgl.nn as dglnn
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics.functional as MF
from dgl.data import AsNodePredDataset
from dgl.multiprocessing import shared_tensor
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel


class SAGE(nn.Module):
    def __init__(self, in_size, hid_size, out_size):
        super().__init__()
        self.layers = nn.ModuleList([
            dglnn.SAGEConv(in_size, hid_size, "mean"),
            dglnn.SAGEConv(hid_size, hid_size, "mean"),
            dglnn.SAGEConv(hid_size, out_size, "mean"),
        ])
        self.dropout = nn.Dropout(0.5)
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

    def inference(self, g, device, batch_size, use_uva):
        g.ndata["h"] = g.ndata["feat"]
        sampler = dgl.dataloading.MultiLayerFullNeighborSampler(1, prefetch_node_feats=["h"])
        for l, layer in enumerate(self.layers):
            loader = dgl.dataloading.DataLoader(
                g, torch.arange(g.num_nodes(), device=device), sampler, device=device,
                batch_size=batch_size, shuffle=False, drop_last=False,
                num_workers=0, use_ddp=True, use_uva=use_uva)
            # the output buffer lives in shared memory so every rank can fill its rows
            y = shared_tensor((g.num_nodes(), self.hid_size if l != len(self.layers) - 1
                               else self.out_size))
            for input_nodes, output_nodes, blocks in loader:
                x = blocks[0].srcdata["h"]
                h = layer(blocks[0], x)
                if l != len(self.layers) - 1:
                    h = F.relu(h)
                y[output_nodes] = h.to(y.device)
            # make sure all ranks have written their part before the next layer reads it
            dist.barrier()
            g.ndata["h"] = y if use_uva else y.to(device)
        g.ndata.pop("h")
        return y


def evaluate(model, g, num_classes, loader):
    model.eval()
    ys, y_hats = [], []
    for input_nodes, output_nodes, blocks in loader:
        with torch.no_grad():
            ys.append(blocks[-1].dstdata["label"])
            y_hats.append(model(blocks, blocks[0].srcdata["feat"]))
    model.train()
    return MF.accuracy(torch.cat(y_hats), torch.cat(ys), task="multiclass",
                       num_classes=num_classes)


def layerwise_infer(proc_id, device, g, num_classes, nid, model, use_uva, batch_size=2**16):
    model.eval()
    with torch.no_grad():
        pred = model.module.inference(g, device, batch_size, use_uva)
        pred = pred[nid]
        labels = g.ndata["label"][nid].to(pred.device)
    if proc_id == 0:
        acc = MF.accuracy(pred, labels, task="multiclass", num_classes=num_classes)
        print(f"test accuracy {acc.item():.4f}", flush=True)


def train(proc_id, nprocs, device, g, num_classes, train_idx, val_idx, model, use_uva, args):
    sampler = dgl.dataloading.NeighborSampler(
        [10, 10, 10], prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = dgl.dataloading.DataLoader(
        g, train_idx, sampler, device=device, batch_size=args.batch_size,
        shuffle=True, drop_last=False, num_workers=0, use_ddp=True, use_uva=use_uva)
    val_loader = dgl.dataloading.DataLoader(
        g, val_idx, sampler, device=device, batch_size=args.batch_size,
        shuffle=True, drop_last=False, num_workers=0, use_ddp=True, use_uva=use_uva)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4)
    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        total_loss = 0.0
        for it, (_, _, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"].long()
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.item()
        acc = evaluate(model, g, num_classes, val_loader).to(device) / nprocs
        dist.reduce(acc, 0)
        if proc_id == 0:
            print(f"epoch {epoch:02d} | loss {total_loss / (it + 1):.4f} | "
                  f"val acc {acc.item():.4f} | {time.time() - t0:.1f}s", flush=True)
            if args.ckpt:
                torch.save(model.module.state_dict(), args.ckpt)


def run(proc_id, nprocs, devices, g, data, args):
    device = devices[proc_id]
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", init_method="tcp://127.0.0.1:12345",
                            world_size=nprocs, rank=proc_id)
    num_classes, train_idx, val_idx, test_idx = data
    train_idx = train_idx.to(device)
    val_idx = val_idx.to(device)
    use_uva = args.mode == "mixed"
    g = g.to(device if args.mode == "puregpu" else "cpu")
    in_size = g.ndata["feat"].shape[1]
    model = SAGE(in_size, 256, num_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[device], output_device=device)
    train(proc_id, nprocs, device, g, num_classes, train_idx, val_idx, model, use_uva, args)
    layerwise_infer(proc_id, device, g, num_classes, test_idx, model, use_uva)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="mixed", choices=["mixed", "puregpu"])
    parser.add_argument("--gpu", type=str, default="0")
    parser.add_argument("--dataset", default="ogbn-products")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--ckpt", default="")
    args = parser.parse_args()
    devices = list(map(int, args.gpu.split(",")))
    nprocs = len(devices)
    assert torch.cuda.is_available(), "must have GPUs to run this example"
    print(f"Training in {args.mode} mode using {nprocs} GPU(s)")

    dataset = AsNodePredDataset(DglNodePropPredDataset(args.dataset))
    g = dataset[0]
    if args.dataset == "ogbn-arxiv":
        g = dgl.to_bidirected(g, copy_ndata=True)
        g = dgl.add_self_loop(g)
    # avoid creating certain graph formats in each sub-process to save memory
    g.create_formats_()
    data = (dataset.num_classes, dataset.train_idx, dataset.val_idx, dataset.test_idx)

    mp.set_start_method("spawn", force=True)
    mp.spawn(run, args=(nprocs, devices, g, data, args), nprocs=nprocs)
