"""ogbn-products GraphSAGE in DGL with periodic checkpoints and resume.

Long runs on the shared queue get pre-empted, so the script saves
`last.pt` every few epochs and can pick up from it with --resume.

    torchrun --standalone --nproc_per_node=4 13_products_dgl_sage_resume.py \
        --ckpt_dir /shared/ckpt/products_dgl --resume
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
from dgl.dataloading import DataLoader, NeighborSampler
from ogb.nodeproppred import DglNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP


class SAGE(nn.Module):
    def __init__(self, in_size, hid_size, out_size, dropout=0.5):
        super().__init__()
        self.layers = nn.ModuleList([
            dglnn.SAGEConv(in_size, hid_size, "mean"),
            dglnn.SAGEConv(hid_size, hid_size, "mean"),
            dglnn.SAGEConv(hid_size, out_size, "mean"),
        ])
        self.dropout = nn.Dropout(dropout)

    def forward(self, blocks, x):
        h = x
        for l, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if l != len(self.layers) - 1:
                h = self.dropout(F.relu(h))
        return h


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/ogb")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=1024)
    p.add_argument("--fanout", default="10,10,10")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--save_every", type=int, default=2)
    p.add_argument("--ckpt_dir", default="/shared/ckpt/products_dgl")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, g, nids, device, num_classes):
    model.eval()
    sampler = NeighborSampler([15, 10, 5], prefetch_node_feats=["feat"], prefetch_labels=["label"])
    loader = DataLoader(g, nids, sampler, device=device, batch_size=4096, shuffle=False,
                        drop_last=False, num_workers=0, use_uva=True)
    correct = torch.zeros((), device=device, dtype=torch.long)
    count = torch.zeros((), device=device, dtype=torch.long)
    for _, _, blocks in loader:
        logits = model(blocks, blocks[0].srcdata["feat"])
        y = blocks[-1].dstdata["label"]
        correct += (logits.argmax(1) == y).sum()
        count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct.float() / count.float()).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        DglNodePropPredDataset("ogbn-products", root=args.root)
    dist.barrier()
    dataset = DglNodePropPredDataset("ogbn-products", root=args.root)
    g, labels = dataset[0]
    g.ndata["label"] = labels.squeeze(1)
    split = dataset.get_idx_split()
    num_classes = dataset.num_classes
    g.create_formats_()

    train_idx = split["train"].to(device)
    val_idx = split["valid"].tensor_split(world)[rank].to(device)
    test_idx = split["test"].tensor_split(world)[rank].to(device)

    sampler = NeighborSampler([int(x) for x in args.fanout.split(",")],
                              prefetch_node_feats=["feat"], prefetch_labels=["label"])
    train_loader = DataLoader(g, train_idx, sampler, device=device, batch_size=args.batch_size,
                              shuffle=True, drop_last=False, num_workers=0,
                              use_ddp=True, use_uva=True)

    model = SAGE(g.ndata["feat"].shape[1], args.hidden, num_classes).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    start_epoch, best_val = 0, 0.0
    last_path = os.path.join(args.ckpt_dir, "last.pt")
    if args.resume and os.path.exists(last_path):
        ckpt = torch.load(last_path)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best_val = ckpt["epoch"] + 1, ckpt["best_val"]
        if rank == 0:
            print(f"resuming from epoch {start_epoch} (best val {best_val:.4f})")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        n_batches = 0
        for input_nodes, output_nodes, blocks in train_loader:
            x = blocks[0].srcdata["feat"]
            y = blocks[-1].dstdata["label"]
            loss = F.cross_entropy(model(blocks, x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            n_batches += 1
        sched.step()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        val_acc = evaluate(model.module, g, val_idx, device, num_classes)
        if rank == 0:
            print(f"epoch {epoch:03d} loss {loss_sum.item() / n_batches:.4f} "
                  f"val {val_acc:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.1f}s", flush=True)
        is_best = val_acc > best_val
        best_val = max(best_val, val_acc)

        if rank == 0 and ((epoch + 1) % args.save_every == 0 or is_best):
            os.makedirs(args.ckpt_dir, exist_ok=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best_val": best_val}
            torch.save(state, last_path + ".tmp")
            os.replace(last_path + ".tmp", last_path)
            if is_best:
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best_model.pt"))

    test_acc = evaluate(model.module, g, test_idx, device, num_classes)
    if rank == 0:
        print(f"final test acc {test_acc:.4f}, best val {best_val:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
