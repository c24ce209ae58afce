#!/usr/bin/env python
"""Heterogeneous GraphSAGE (R-GCN style) on ogbn-mag with PyG NeighborLoader.

Non-paper node types use the metapath2vec features shipped by PyG's OGB_MAG, so
every type has a 128-d input. Paper seeds are shuffled with a shared seed each
epoch and split evenly over the ranks. Supports resuming from the last
checkpoint, since a full run is ~6 h on 4 GPUs.

    torchrun --nproc_per_node=4 09_rgcn_ogbn_mag.py --root data/mag --epochs 30
    torchrun --nproc_per_node=4 09_rgcn_ogbn_mag.py --root data/mag --resume ckpt/mag/last.pt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_geometric.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.datasets import OGB_MAG
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import HeteroConv, SAGEConv


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/mag")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fanout", type=int, nargs="+", default=[25, 20])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--ckpt-dir", default="ckpt/mag")
    p.add_argument("--resume", default="")
    return p.parse_args()


class HeteroSAGE(nn.Module):
    def __init__(self, metadata, in_dim, hidden, out_dim, num_layers, dropout=0.5):
        super().__init__()
        _, edge_types = metadata
        # walk back from the paper head: layer i only needs to update the node
        # types that some edge of layer i+1 reads from
        needed = [None] * num_layers
        targets = {"paper"}
        for i in reversed(range(num_layers)):
            needed[i] = [et for et in edge_types if et[-1] in targets]
            targets = {et[0] for et in needed[i]}
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        for i in range(num_layers):
            d_in = in_dim if i == 0 else hidden
            self.convs.append(HeteroConv(
                {et: SAGEConv((d_in, d_in), hidden) for et in needed[i]}, aggr="sum"))
            dst_types = sorted({et[-1] for et in needed[i]})
            self.norms.append(nn.ModuleDict({nt: nn.LayerNorm(hidden) for nt in dst_types}))
        self.head = nn.Linear(hidden, out_dim)
        self.dropout = dropout

    def forward(self, x_dict, edge_index_dict):
        for conv, norms in zip(self.convs, self.norms):
            x_dict = conv(x_dict, edge_index_dict)
            x_dict = {k: F.dropout(F.relu(norms[k](v)), self.dropout, self.training)
                      for k, v in x_dict.items()}
        return self.head(x_dict["paper"])


def shard(idx, epoch, seed, rank, world):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = idx[torch.randperm(idx.numel(), generator=g)]
    n = perm.numel() // world * world
    return perm[:n][rank::world]


def make_loader(data, idx, fanout, batch_size, shuffle):
    return NeighborLoader(data, num_neighbors=fanout, input_nodes=("paper", idx),
                          batch_size=batch_size, shuffle=shuffle, num_workers=6,
                          persistent_workers=False)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(2, device=device)
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        bs = batch["paper"].batch_size
        out = model(batch.x_dict, batch.edge_index_dict)[:bs]
        correct[0] += (out.argmax(-1) == batch["paper"].y[:bs]).sum()
        correct[1] += bs
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    # the dataset is downloaded and processed by a one-off `python -c` before launching
    dataset = OGB_MAG(args.root, preprocess="metapath2vec", transform=T.ToUndirected())
    data = dataset[0]
    train_idx = data["paper"].train_mask.nonzero().view(-1)
    val_idx = data["paper"].val_mask.nonzero().view(-1)
    val_loader = make_loader(data, val_idx[rank::world], args.fanout, 4096, shuffle=False)

    model = HeteroSAGE(data.metadata(), 128, args.hidden, dataset.num_classes,
                       args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        loader = make_loader(data, shard(train_idx, epoch, args.seed, rank, world),
                             args.fanout, args.batch_size, shuffle=False)
        loss_sum = torch.zeros(2, device=device)
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            bs = batch["paper"].batch_size
            out = model(batch.x_dict, batch.edge_index_dict)[:bs]
            loss = F.cross_entropy(out, batch["paper"].y[:bs])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum[0] += loss.detach() * bs
            loss_sum[1] += bs
        sched.step()
        dist.all_reduce(loss_sum)
        val_acc = evaluate(model, val_loader, device)

        if rank == 0:
            print(f"epoch {epoch:02d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                  f"val {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            best = max(best, val_acc)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, os.path.join(args.ckpt_dir, "last.pt"))
            if val_acc >= best:
                torch.save(state, os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
