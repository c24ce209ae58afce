"""GraphSAGE + BatchNorm on ogbn-products: mixed precision, gradient
accumulation and resumable checkpoints, one process per GPU.

    torchrun --standalone --nproc_per_node=8 13_products_sage_amp_accum.py \
        --accum_steps 2 --wandb
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ogb.nodeproppred import PygNodePropPredDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader
from torch_geometric.nn import SAGEConv


class SAGEBN(nn.Module):
    def __init__(self, in_dim, hidden, out_dim, num_layers=3, dropout=0.5):
        super().__init__()
        self.convs = nn.ModuleList()
        self.bns = nn.ModuleList()
        for i in range(num_layers):
            self.convs.append(SAGEConv(in_dim if i == 0 else hidden,
                                       out_dim if i == num_layers - 1 else hidden))
            if i < num_layers - 1:
                self.bns.append(nn.BatchNorm1d(hidden))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = self.bns[i](x)
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ogb")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=512, help="seed nodes per GPU per micro-batch")
    ap.add_argument("--accum_steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--fanout", type=int, nargs="+", default=[15, 10, 5])
    ap.add_argument("--ckpt", default="checkpoints/sage_bn_products/last.pt")
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype):
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        batch = batch.to(device)
        with torch.autocast("cuda", dtype=amp_dtype):
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
        y = batch.y[: batch.batch_size].view(-1)
        hits[0] += (out.argmax(-1) == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    amp_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=(amp_dtype == torch.float16))

    if rank == 0:
        PygNodePropPredDataset("ogbn-products", root=args.root)
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
    dist.barrier()
    dataset = PygNodePropPredDataset("ogbn-products", root=args.root)
    data = dataset[0]
    split = dataset.get_idx_split()

    # identical shard sizes on every rank -> identical number of steps
    n_train = split["train"].numel() // world
    train_idx = split["train"][rank * n_train:(rank + 1) * n_train]
    valid_idx = split["valid"].tensor_split(world)[rank]
    test_idx = split["test"].tensor_split(world)[rank]

    kw = dict(num_neighbors=args.fanout, num_workers=4)
    train_loader = NeighborLoader(data, input_nodes=train_idx, batch_size=args.batch_size,
                                  shuffle=True, drop_last=True, persistent_workers=True, **kw)
    valid_loader = NeighborLoader(data, input_nodes=valid_idx, batch_size=4096, **kw)
    test_loader = NeighborLoader(data, input_nodes=test_idx, batch_size=4096, **kw)

    model = SAGEBN(dataset.num_features, args.hidden, dataset.num_classes).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    # global batch = batch_size * accum_steps * world; scale lr linearly from 8 x 512 x 2
    lr = args.lr * (args.batch_size * args.accum_steps * world) / (512 * 2 * 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = -(-len(train_loader) // args.accum_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, epochs=args.epochs, steps_per_epoch=steps_per_epoch)

    start_epoch, best = 0, 0.0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, best = state["epoch"] + 1, state["best"]

    run = None
    if rank == 0 and args.wandb:
        import wandb
        run = wandb.init(project="ogbn-products", config={**vars(args), "world": world, "lr": lr})

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        n_batches = len(train_loader)
        for i, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            do_step = (i + 1) % args.accum_steps == 0 or (i + 1) == n_batches
            ctx = contextlib.nullcontext() if do_step else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=amp_dtype):
                    out = model(batch.x, batch.edge_index)[: batch.batch_size]
                    loss = F.cross_entropy(out.float(), batch.y[: batch.batch_size].view(-1))
                scaler.scale(loss / args.accum_steps).backward()
            if do_step:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            tot[0] += loss.detach().float()
            tot[1] += 1
        dist.all_reduce(tot)

        val_acc = evaluate(model.module, valid_loader, device, amp_dtype)
        test_acc = evaluate(model.module, test_loader, device, amp_dtype)
        best = max(best, val_acc)
        if rank == 0:
            msg = {"epoch": epoch, "loss": (tot[0] / tot[1]).item(), "val_acc": val_acc,
                   "test_acc": test_acc, "lr": scheduler.get_last_lr()[0],
                   "epoch_s": time.time() - t0}
            print(msg, flush=True)
            if run is not None:
                run.log(msg)
            torch.save({"model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(),
                        "epoch": epoch, "best": best}, args.ckpt)
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
