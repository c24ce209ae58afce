"""ogbn-arxiv with a 3-layer GAT in DGL, mini-batch training on several GPUs.

The graph is loaded and made bidirected once in the parent process and
shared with one worker process per GPU.

    python 16_arxiv_dgl_gat_spawn.py --gpus 0,1,2,3 --epochs 100
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
from dgl.dataloading import DataLoader, MultiLayerFullNeighborSampler, NeighborSampler
from ogb.nodeproppred import DglNodePropPredDataset, Evaluator
from torch.nn.parallel import DistributedDataParallel


class GAT(nn.Module):
    def __init__(self, in_size, hid_size, out_size, heads=(4, 4, 1), feat_drop=0.3, attn_drop=0.1):
        super().__init__()
        self.hid_size = hid_size
        self.heads = heads
        self.layers = nn.ModuleList([
            dglnn.GATConv(in_size, hid_size, heads[0], feat_drop, attn_drop,
                          activation=F.elu, allow_zero_in_degree=True),
            dglnn.GATConv(hid_size * heads[0], hid_size, heads[1], feat_drop, attn_drop,
                          residual=True, activation=F.elu, allow_zero_in_degree=True),
            dglnn.GATConv(hid_size * heads[1], out_size, heads[2], feat_drop, attn_drop,
                          residual=True, activation=None, allow_zero_in_degree=True),
        ])

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            h = h.flatten(1) if l != len(self.layers) - 1 else h.mean(1)
        return h

    @torch.no_grad()
    def inference(self, g, device, batch_size):
        feat = g.ndata["feat"]
        sampler = MultiLayerFullNeighborSampler(1)
        loader = DataLoader(g, torch.arange(g.num_nodes()), sampler, device=device,
                            batch_size=batch_size, shuffle=False, drop_last=False, num_workers=0)
        for l, layer in enumerate(self.layers):
            ys = []
            for input_nodes, output_nodes, blocks in loader:
                h = layer(blocks[0], feat[input_nodes].to(device))
                h = h.flatten(1) if l != len(self.layers) - 1 else h.mean(1)
                ys.append(h.cpu())
            feat = torch.cat(ys, dim=0)
        return feat


def run(proc_id, nprocs, devices, g, data, args):
    device = devices[proc_id]
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", init_method="tcp://127.0.0.1:29533",
                            world_size=nprocs, rank=proc_id)
    num_classes, labels, split_idx = data
    train_idx = split_idx["train"].to(device)

    sampler = NeighborSampler([10, 10, 10], prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = DataLoader(g, train_idx, sampler, device=device, batch_size=args.batch_size,
                              shuffle=True, drop_last=False, num_workers=0,
                              use_ddp=True, use_uva=True)

    model = GAT(g.ndata["feat"].shape[1], args.hidden, num_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[device], output_device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    evaluator = Evaluator(name="ogbn-arxiv")

    best_val, best_test = 0.0, 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for input_nodes, output_nodes, blocks in train_loader:
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        if proc_id == 0:
            msg = f"epoch {epoch:03d} loss {(running[0] / running[1]).item():.4f} " \
                  f"{time.time() - t0:.1f}s"
            if (epoch + 1) % args.eval_every == 0:
                model.eval()
                pred = model.module.inference(g, device, 8192).argmax(1, keepdim=True)
                val = evaluator.eval({"y_true": labels[split_idx["valid"]],
                                      "y_pred": pred[split_idx["valid"]]})["acc"]
                test = evaluator.eval({"y_true": labels[split_idx["test"]],
                                       "y_pred": pred[split_idx["test"]]})["acc"]
                msg += f" | val {val:.4f} test {test:.4f}"
                if val > best_val:
                    best_val, best_test = val, test
                    os.makedirs(args.out_dir, exist_ok=True)
                    torch.save(model.module.state_dict(), os.path.join(args.out_dir, "gat_arxiv.pt"))
            print(msg, flush=True)
        dist.barrier()

    if proc_id == 0:
        print(f"best val {best_val:.4f}, test {best_test:.4f}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", default="0,1,2,3")
    parser.add_argument("--root", default="dataset")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--out_dir", default="checkpoints")
    args = parser.parse_args()

    dataset = DglNodePropPredDataset("ogbn-arxiv", root=args.root)
    g, labels = dataset[0]
    # arxiv is a citation DAG; add reverse edges so messages flow both ways
    srcs, dsts = g.all_edges()
    g.add_edges(dsts, srcs)
    g = dgl.to_simple(g, copy_ndata=True)
    g.ndata["label"] = labels.squeeze(1)
    g.create_formats_()
    split_idx = dataset.get_idx_split()

    devices = [int(d) for d in args.gpus.split(",")]
    nprocs = len(devices)
    data = (dataset.num_classes, labels, split_idx)
    mp.spawn(run, args=(devices, nprocs, g, data, args), nprocs=nprocs)


if __name__ == "__main__":
    main()
