#!/usr/bin/env python
# Session co-occurrence graph: item-item link prediction with GraphSAGE.
# Long job on the shared queue, so it checkpoints every epoch and can be resumed:
#
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
#       sage_session.py --graph /mnt/graphs/session_cooc/v12 --ckpt-dir /mnt/ckpt/sage_session \
#       --resume /mnt/ckpt/sage_session/last.pt
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.nn import SAGEConv


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--graph", required=True, help="dir with train.pt / val.pt (torch_geometric Data)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=1024, help="per GPU; lr was tuned on 16 GPUs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fanout", default="25,10")
    p.add_argument("--num-workers", type=int, default=6)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--k", type=int, default=50)
    return p


class Encoder(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.conv1 = SAGEConv(hidden, hidden, aggr="mean")
        self.conv2 = SAGEConv(hidden, hidden, aggr="mean")
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, edge_index, edge_label_index):
        h = self.inp(x).relu()
        h = self.conv1(h, edge_index).relu()
        h = self.norm(self.conv2(h, edge_index))
        return (h[edge_label_index[0]] * h[edge_label_index[1]]).sum(-1)


def make_loader(data, eli, lbl, fanout, bs, workers, shuffle, neg_ratio):
    return LinkNeighborLoader(data, num_neighbors=fanout, edge_label_index=eli, edge_label=lbl,
                              neg_sampling_ratio=neg_ratio, batch_size=bs, shuffle=shuffle,
                              drop_last=shuffle, num_workers=workers, persistent_workers=shuffle)


@torch.no_grad()
def evaluate(model, val, fanout, args, rank, world, device):
    model.eval()
    eli = val.edge_label_index[:, rank::world]
    lbl = val.edge_label[rank::world]
    loader = make_loader(val, eli, lbl, fanout, 4 * args.batch_size, args.num_workers, False, None)
    pos, neg = [], []
    for b in loader:
        b = b.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            s = model.module(b.x, b.edge_index, b.edge_label_index).float()
        pos.append(s[b.edge_label == 1])
        neg.append(s[b.edge_label == 0])
    pos, neg = torch.cat(pos), torch.cat(neg)
    top = neg.topk(args.k).values
    tops = [torch.empty_like(top) for _ in range(world)]
    dist.all_gather(tops, top)
    kth = torch.cat(tops).topk(args.k).values[-1]
    c = torch.stack([(pos > kth).sum().float(), torch.tensor(float(pos.numel()), device=device)])
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def save_checkpoint(path, model, opt, sched, epoch, best):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "best": best}, tmp)
    os.replace(tmp, path)


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    fanout = [int(x) for x in args.fanout.split(",")]

    train = torch.load(os.path.join(args.graph, "train.pt"))
    val = torch.load(os.path.join(args.graph, "val.pt"))

    n = train.edge_label_index.size(1) // world * world
    perm = torch.randperm(train.edge_label_index.size(1), generator=torch.Generator().manual_seed(0))[:n]
    mine = perm.view(world, -1)[rank]
    loader = make_loader(train, train.edge_label_index[:, mine], train.edge_label[mine], fanout,
                         args.batch_size, args.num_workers, True, 1.0)

    model = DDP(Encoder(train.num_features, args.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader),
                                                pct_start=0.05)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}, best hits@{args.k}={best:.4f}")

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for b in loader:
            b = b.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                logit = model(b.x, b.edge_index, b.edge_label_index)
            loss = F.binary_cross_entropy_with_logits(logit.float(), b.edge_label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)
        hits = evaluate(model, val, fanout, args, rank, world, device)

        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4f} val hits@{args.k} {hits:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if hits > best:
                best = hits
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best_model.pt"))
            save_checkpoint(os.path.join(args.ckpt_dir, "last.pt"), model, opt, sched, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
