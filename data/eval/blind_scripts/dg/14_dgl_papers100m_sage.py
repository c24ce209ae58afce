"""GraphSAGE on ogbn-papers100M with DGL, multi-GPU, UVA feature access.

The graph (111M nodes, 1.6B edges after adding reverse edges) is loaded once
in the parent process and shared with the GPU workers.

    python 14_dgl_papers100m_sage.py --gpus 0,1,2,3,4,5,6,7 --ckpt_dir /shared/ckpt/papers
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
from dgl.dataloading import DataLoader, NeighborSampler
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP


class SAGE(nn.Module):
    def __init__(self, in_feats, hidden, n_classes, n_layers=3, dropout=0.2):
        super().__init__()
        self.layers = nn.ModuleList()
        self.norms = nn.ModuleList()
        for i in range(n_layers):
            in_dim = in_feats if i == 0 else hidden
            out_dim = n_classes if i == n_layers - 1 else hidden
            self.layers.append(dglnn.SAGEConv(in_dim, out_dim, "mean"))
            if i < n_layers - 1:
                self.norms.append(nn.LayerNorm(hidden))
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x):
        h = self.dropout(x)
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = self.norms[l](h)
                h = F.relu(h)
                h = self.dropout(h)
        return h


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for _, _, blocks in loader:
        out = model(blocks, blocks[0].srcdata["feat"])
        y = blocks[-1].dstdata["label"]
        acc[0] += (out.argmax(-1) == y).sum()
        acc[1] += y.shape[0]
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def worker(proc_id, n_procs, gpus, g, splits, n_classes, args):
    dev_id = gpus[proc_id]
    device = torch.device(f"cuda:{dev_id}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}",
                            world_size=n_procs, rank=proc_id)

    train_idx, valid_idx, test_idx = (s.to(device) for s in splits)
    sampler = NeighborSampler([int(f) for f in args.fanout.split(",")],
                              prefetch_node_feats=["feat"], prefetch_labels=["label"])

    def make_loader(idx, bs, shuffle):
        return DataLoader(g, idx, sampler, device=device, batch_size=bs, shuffle=shuffle,
                          drop_last=False, num_workers=0, use_ddp=True, use_uva=True)

    train_loader = make_loader(train_idx, args.batch_size, True)
    valid_loader = make_loader(valid_idx, 4096, False)
    test_loader = make_loader(test_idx, 4096, False)

    model = SAGE(g.ndata["feat"].shape[1], args.hidden, n_classes).to(device)
    model = DDP(model, device_ids=[dev_id], output_device=dev_id)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best_valid = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        running = torch.zeros(2, device=device)
        for step, (_, _, blocks) in enumerate(train_loader):
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
            if proc_id == 0 and step % args.log_every == 0:
                print(f"  epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f}",
                      flush=True)
        dist.all_reduce(running)

        valid_acc = evaluate(model.module, valid_loader, device)
        sched.step(valid_acc)
        if proc_id == 0:
            print(f"Epoch {epoch:02d} | loss {(running[0] / running[1]).item():.4f} | "
                  f"valid {valid_acc:.4f} | {time.time() - tic:.0f}s", flush=True)

        state = {"epoch": epoch, "model": model.module.state_dict(),
                 "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "valid_acc": valid_acc}
        torch.save(state, os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pt"))
        if valid_acc > best_valid:
            best_valid = valid_acc
            torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_acc = evaluate(model.module, test_loader, device)
    if proc_id == 0:
        print(f"best valid {best_valid:.4f} (epoch {ckpt['epoch']}), test {test_acc:.4f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--gpus", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--fanout", default="12,12,12")
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--log_every", type=int, default=200)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--ckpt_dir", default="ckpt/papers100m_sage")
    args = ap.parse_args()

    gpus = [int(x) for x in args.gpus.split(",")]
    dataset = DglNodePropPredDataset("ogbn-papers100M", root=args.root)
    g, labels = dataset[0]
    splits = dataset.get_idx_split()
    labels = labels[:, 0]
    n_classes = int(torch.nan_to_num(labels, nan=0).max().item()) + 1
    g.ndata["label"] = torch.nan_to_num(labels, nan=-1).long()
    g = dgl.add_reverse_edges(g, copy_ndata=True)
    g.create_formats_()
    print(g, flush=True)

    split_tuple = (splits["train"], splits["valid"], splits["test"])
    mp.spawn(worker, args=(len(gpus), gpus, g, split_tuple, n_classes, args), nprocs=len(gpus))


if __name__ == "__main__":
    main()
