"""Multi-GPU GAT training on ogbn-arxiv with DGL neighbour sampling.

Uses UVA sampling: the graph stays in pinned host memory, every GPU samples from it.

    python 14_dgl_gat_arxiv.py --gpu 0,1,2,3 --mode puregpu
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
from dgl.dataloading import DataLoader, NeighborSampler
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel


class GAT(nn.Module):
    def __init__(self, in_size, hid_size, out_size, heads=(4, 4, 1), feat_drop=0.2, attn_drop=0.1):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(dglnn.GATConv(in_size, hid_size, heads[0], feat_drop, attn_drop,
                                         activation=F.elu, allow_zero_in_degree=True))
        self.layers.append(dglnn.GATConv(hid_size * heads[0], hid_size, heads[1], feat_drop, attn_drop,
                                         activation=F.elu, allow_zero_in_degree=True))
        self.layers.append(dglnn.GATConv(hid_size * heads[1], out_size, heads[2], feat_drop, attn_drop,
                                         activation=None, allow_zero_in_degree=True))
        self.norms = nn.ModuleList([nn.BatchNorm1d(hid_size * heads[0]),
                                    nn.BatchNorm1d(hid_size * heads[1])])
        self.hid_size, self.out_size = hid_size, out_size

    def forward(self, blocks, x):
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i < len(self.layers) - 1:
                h = self.norms[i](h.flatten(1))
            else:
                h = h.mean(1)
        return h


@torch.no_grad()
def evaluate(model, g, num_classes, dataloader):
    model.eval()
    ys, y_hats = [], []
    for _, _, blocks in dataloader:
        x = blocks[0].srcdata["feat"]
        ys.append(blocks[-1].dstdata["label"])
        y_hats.append(model(blocks, x))
    y, y_hat = torch.cat(ys), torch.cat(y_hats)
    acc = MF.accuracy(y_hat, y, task="multiclass", num_classes=num_classes)
    return torch.stack([acc * y.numel(), torch.tensor(float(y.numel()), device=y.device)])


def make_loader(g, idx, device, fanouts, batch_size, shuffle, use_uva, use_ddp):
    sampler = NeighborSampler(fanouts, prefetch_node_feats=["feat"], prefetch_labels=["label"])
    return DataLoader(g, idx, sampler, device=device, batch_size=batch_size, shuffle=shuffle,
                      drop_last=False, num_workers=0, use_ddp=use_ddp, use_uva=use_uva)


def run(args, proc_id, nprocs, devices, g, data):
    device = devices[proc_id]
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", init_method="tcp://127.0.0.1:12345",
                            world_size=nprocs, rank=proc_id)
    num_classes, train_idx, val_idx, test_idx = data
    train_idx, val_idx = train_idx.to(device), val_idx.to(device)
    g = g.to(device if args.mode == "puregpu" else "cpu")
    use_uva = args.mode == "mixed"

    in_size = g.ndata["feat"].shape[1]
    model = GAT(in_size, args.hidden, num_classes).to(device)
    model = DistributedDataParallel(model, device_ids=[device], output_device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    fanouts = [int(f) for f in args.fanouts.split(",")]
    train_loader = make_loader(g, train_idx, device, fanouts, args.batch_size, True, use_uva, True)
    # validation: a disjoint slice per rank (no padding), evaluated on the bare module
    my_val = val_idx.tensor_split(nprocs)[proc_id]
    val_loader = make_loader(g, my_val, device, fanouts, args.batch_size, False, use_uva, False)

    best_acc = 0.0
    for epoch in range(args.epochs):
        t0 = time.time()
        model.train()
        total_loss = torch.zeros(2, device=device)
        for it, (_, _, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            y_hat = model(blocks, x)
            loss = F.cross_entropy(y_hat, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        correct = evaluate(model.module, g, num_classes, val_loader)
        dist.all_reduce(total_loss)
        dist.all_reduce(correct)
        if proc_id == 0:
            val_acc = (correct[0] / correct[1]).item()
            print(f"Epoch {epoch:03d} | Loss {(total_loss[0] / total_loss[1]).item():.4f} | "
                  f"Val Acc {val_acc:.4f} | Time {time.time() - t0:.2f}s", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "gat_arxiv.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="mixed", choices=["mixed", "puregpu"])
    parser.add_argument("--gpu", type=str, default="0")
    parser.add_argument("--root", default="dataset")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--fanouts", default="10,10,10")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--out", default="checkpoints")
    args = parser.parse_args()
    devices = list(map(int, args.gpu.split(",")))
    nprocs = len(devices)
    assert torch.cuda.is_available(), "must have GPU(s) to run this example"
    print(f"Training in {args.mode} mode using {nprocs} GPU(s)")

    dataset = AsNodePredDataset(DglNodePropPredDataset("ogbn-arxiv", root=args.root))
    g = dataset[0]
    g = dgl.add_reverse_edges(g)
    g = dgl.add_self_loop(g)
    g.ndata["label"] = g.ndata["label"].long()
    if args.mode == "mixed":
        g.create_formats_()
    data = (dataset.num_classes, dataset.train_idx, dataset.val_idx, dataset.test_idx)

    mp.spawn(run, args=(args, nprocs, devices, g, data), nprocs=nprocs)
