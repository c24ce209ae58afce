#!/usr/bin/env python
# Multi-GPU GAT on ogbn-products with DGL neighbour sampling (UVA feature fetch).
#
#   torchrun --standalone --nproc_per_node=8 02_dgl_gat_products.py --epochs 30
#
import argparse
import logging
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
from dgl.dataloading import DataLoader, NeighborSampler
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger("gat_products")


class GAT(nn.Module):
    def __init__(self, in_size, hid_size, out_size, heads, feat_drop=0.2, attn_drop=0.1):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(
            dglnn.GATConv(in_size, hid_size, heads[0], feat_drop=feat_drop,
                          attn_drop=attn_drop, activation=F.elu)
        )
        self.layers.append(
            dglnn.GATConv(hid_size * heads[0], hid_size, heads[1], feat_drop=feat_drop,
                          attn_drop=attn_drop, activation=F.elu)
        )
        self.layers.append(
            dglnn.GATConv(hid_size * heads[1], out_size, heads[2], feat_drop=feat_drop,
                          attn_drop=attn_drop, activation=None)
        )

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l == len(self.layers) - 1:
                h = h.mean(1)
            else:
                h = h.flatten(1)
        return h


def reduce_mean(value, device):
    t = torch.as_tensor(value, dtype=torch.float32, device=device).clone()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


@torch.no_grad()
def evaluate(model, dataloader, num_classes):
    model.eval()
    ys, y_hats = [], []
    for _, _, blocks in dataloader:
        x = blocks[0].srcdata["feat"]
        ys.append(blocks[-1].dstdata["label"])
        y_hats.append(model(blocks, x))
    return MF.accuracy(
        torch.cat(y_hats), torch.cat(ys), task="multiclass", num_classes=num_classes
    ).item()


def build_loader(g, nids, sampler, device, batch_size, shuffle):
    return DataLoader(
        g, nids, sampler,
        device=device,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=False,
        num_workers=0,
        use_ddp=True,
        use_uva=True,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset_dir", default="/datasets/ogb")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", default="4,4,1")
    p.add_argument("--fanout", default="10,10,10")
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ckpt_dir", default="checkpoints/gat_products")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s [%(levelname)s] %(message)s",
    )

    if rank == 0:
        DglNodePropPredDataset("ogbn-products", root=args.dataset_dir)
    dist.barrier()
    dataset = AsNodePredDataset(DglNodePropPredDataset("ogbn-products", root=args.dataset_dir))
    g = dataset[0]
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    g.create_formats_()
    num_classes = dataset.num_classes
    train_idx = dataset.train_idx.to(device)
    val_idx = dataset.val_idx.to(device)
    test_idx = dataset.test_idx.to(device)

    fanout = [int(x) for x in args.fanout.split(",")]
    sampler = NeighborSampler(fanout, prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = build_loader(g, train_idx, sampler, device, args.batch_size, True)
    val_loader = build_loader(g, val_idx, sampler, device, 4096, False)
    test_loader = build_loader(g, test_idx, sampler, device, 4096, False)

    heads = [int(h) for h in args.heads.split(",")]
    model = GAT(g.ndata["feat"].shape[1], args.hidden, num_classes, heads).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        log.info("train/val/test = %d/%d/%d, %d GPUs",
                 len(train_idx), len(val_idx), len(test_idx), world_size)

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        total_loss, steps = 0.0, 0
        for _, _, blocks in train_loader:
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            y_hat = model(blocks, x)
            loss = F.cross_entropy(y_hat, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total_loss += loss.item()
            steps += 1
        sched.step()
        train_loss = reduce_mean(total_loss / max(steps, 1), device)

        val_acc = evaluate(model.module, val_loader, num_classes)
        if rank == 0:
            log.info("epoch %03d | loss %.4f | val acc %.4f | %.1fs",
                     epoch, train_loss, val_acc, time.time() - t0)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict(),
                            "val_acc": val_acc},
                           os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.ckpt_dir, "best.pt"), map_location=device)
    model.module.load_state_dict(ckpt["state_dict"])
    test_acc = evaluate(model.module, test_loader, num_classes)
    if rank == 0:
        log.info("best val acc %.4f (epoch %d) | test acc %.4f",
                 best_acc, ckpt["epoch"], test_acc)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
