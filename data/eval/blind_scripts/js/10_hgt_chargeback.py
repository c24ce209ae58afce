"""Chargeback prediction with a Heterogeneous Graph Transformer (HGT).

Node types: user, merchant, txn, device. Trained on transactions before --cutoff,
validated on the following weeks. Reports PR-AUC over the whole validation set
(scores from all ranks are gathered).

    torchrun --nproc_per_node=8 10_hgt_chargeback.py --graph /shared/graphs/chargeback_2024q2.pt
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, precision_recall_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import HGTLoader
from torch_geometric.nn import HGTConv, Linear

log = logging.getLogger("hgt")


class HGT(nn.Module):
    def __init__(self, metadata, hidden=128, heads=4, num_layers=2):
        super().__init__()
        self.lin_in = nn.ModuleDict({nt: Linear(-1, hidden) for nt in metadata[0]})
        self.convs = nn.ModuleList(HGTConv(hidden, hidden, metadata, heads) for _ in range(num_layers))
        self.out = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.GELU(), nn.Linear(hidden // 2, 1))

    def forward(self, x_dict, edge_index_dict):
        h = {nt: F.gelu(self.lin_in[nt](x)) for nt, x in x_dict.items()}
        for conv in self.convs:
            h = conv(h, edge_index_dict)
        return self.out(h["txn"]).squeeze(-1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", required=True)
    ap.add_argument("--ckpt-dir", default="/shared/ckpt/hgt_chargeback")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=256, help="nodes sampled per type per hop")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true")
    return ap.parse_args()


def make_loader(data, idx, args, shuffle):
    return HGTLoader(
        data,
        num_samples={nt: [args.samples] * args.layers for nt in data.node_types},
        input_nodes=("txn", idx),
        batch_size=args.batch_size,
        shuffle=shuffle,
        num_workers=4,
        persistent_workers=True,
    )


@torch.no_grad()
def gather_scores(model, loader, device, world, bf16):
    model.eval()
    scores, labels = [], []
    for batch in loader:
        batch = batch.to(device)
        bs = batch["txn"].batch_size
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logit = model.module(batch.x_dict, batch.edge_index_dict)[:bs]
        scores.append(torch.sigmoid(logit.float()))
        labels.append(batch["txn"].y[:bs].float())
    s, y = torch.cat(scores), torch.cat(labels)
    all_s = [torch.zeros_like(s) for _ in range(world)]
    all_y = [torch.zeros_like(y) for _ in range(world)]
    dist.all_gather(all_s, s)
    dist.all_gather(all_y, y)
    return torch.cat(all_s).cpu().numpy(), torch.cat(all_y).cpu().numpy()


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s | %(message)s")

    data = torch.load(args.graph, map_location="cpu", weights_only=False)
    txn = data["txn"]
    train_idx = txn.train_mask.nonzero().view(-1)
    val_idx = txn.val_mask.nonzero().view(-1)
    log.info("%s | train %d val %d | val chargeback rate %.4f%%", data.node_types, train_idx.numel(),
             val_idx.numel(), 100 * txn.y[val_idx].float().mean().item())

    g = torch.Generator().manual_seed(7)
    train_idx = train_idx[torch.randperm(train_idx.numel(), generator=g)]
    per = train_idx.numel() // world
    train_loader = make_loader(data, train_idx[rank * per:(rank + 1) * per], args, shuffle=True)
    val_loader = make_loader(data, val_idx.tensor_split(world)[rank], args, shuffle=False)

    torch.manual_seed(0)
    model = HGT(data.metadata(), args.hidden, args.heads, args.layers).to(device)
    with torch.no_grad():  # materialise the lazy Linear(-1, ...) layers before DDP sees the parameters
        warm = next(iter(make_loader(data, train_idx[:64], args, shuffle=False))).to(device)
        model(warm.x_dict, warm.edge_index_dict)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)
    pos = txn.y[train_idx].sum().item()
    pos_weight = torch.tensor(min(50.0, (train_idx.numel() - pos) / max(pos, 1)), device=device)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros((), device=device)
        for step, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            bs = batch["txn"].batch_size
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
                logit = model(batch.x_dict, batch.edge_index_dict)[:bs]
            loss = F.binary_cross_entropy_with_logits(logit.float(), batch["txn"].y[:bs].float(),
                                                      pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        s, y = gather_scores(model, val_loader, device, world, args.bf16)
        if rank == 0:
            ap = average_precision_score(y, s)
            prec, rec, _ = precision_recall_curve(y, s)
            r90 = rec[prec >= 0.9].max() if (prec >= 0.9).any() else 0.0
            log.info("epoch %d  loss %.4f  val PR-AUC %.4f  recall@P90 %.3f  (%.0fs)",
                     epoch, loss_sum.item() / len(train_loader), ap, r90, time.time() - t0)
            if ap > best:
                best = ap
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "val_ap": ap},
                           os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
