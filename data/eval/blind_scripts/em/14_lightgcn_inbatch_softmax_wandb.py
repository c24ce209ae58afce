#!/usr/bin/env python
"""LightGCN with in-batch sampled softmax (logQ-corrected) for the "similar shoppers" feed.

    torchrun --nproc_per_node=8 lightgcn_softmax.py --graph /mnt/graphs/feed/2024-06-10.pt \
        --wandb-project recsys-graph --run-name lgcn_softmax_t0.07
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LightGCN
from torch_geometric.utils import degree


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", required=True)
    ap.add_argument("--ckpt-dir", default="/mnt/experiments/lgcn_softmax")
    ap.add_argument("--wandb-project", default="recsys-graph")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.07)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4096, help="per GPU; negatives are the batch's items")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=1e-6)
    ap.add_argument("--k", type=int, nargs="+", default=[20, 100])
    return ap.parse_args()


class Encoder(torch.nn.Module):
    """LightGCN propagation only; returns the final embedding of every node."""

    def __init__(self, num_nodes, dim, layers):
        super().__init__()
        self.lgcn = LightGCN(num_nodes, dim, layers)

    def forward(self, edge_index):
        return self.lgcn.get_embedding(edge_index)


def sampled_softmax_loss(u, i, item_logq, temperature):
    u = F.normalize(u, dim=-1)
    i = F.normalize(i, dim=-1)
    logits = u @ i.t() / temperature - item_logq.unsqueeze(0)
    labels = torch.arange(u.size(0), device=u.device)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def topk_metrics(model, edge_index, train_ei, test_ei, nu, ks, rank, world, device):
    emb = model.module(edge_index)
    ue, ie = F.normalize(emb[:nu], dim=-1), F.normalize(emb[nu:], dim=-1)
    users = torch.unique(test_ei[0])[rank::world]
    kmax = max(ks)
    disc = 1.0 / torch.log2(torch.arange(kmax, device=device, dtype=torch.float) + 2)
    sums = torch.zeros(2 * len(ks) + 1, device=device)
    for chunk in users.split(2048):
        pos_in_chunk = torch.full((nu,), -1, dtype=torch.long, device=device)
        pos_in_chunk[chunk] = torch.arange(chunk.numel(), device=device)
        scores = ue[chunk] @ ie.t()
        r = pos_in_chunk[train_ei[0]]
        scores[r[r >= 0], train_ei[1, r >= 0]] = -math.inf
        truth = torch.zeros_like(scores, dtype=torch.bool)
        r = pos_in_chunk[test_ei[0]]
        truth[r[r >= 0], test_ei[1, r >= 0]] = True
        rel = truth.gather(1, scores.topk(kmax, dim=1).indices).float()
        n_true = truth.sum(1)
        for j, k in enumerate(ks):
            sums[2 * j] += (rel[:, :k].sum(1) / n_true.clamp(max=k)).sum()
            idcg = disc[:k].cumsum(0)[n_true.clamp(max=k) - 1]
            sums[2 * j + 1] += ((rel[:, :k] * disc[:k]).sum(1) / idcg).sum()
        sums[-1] += chunk.numel()
    dist.all_reduce(sums)
    out = {}
    for j, k in enumerate(ks):
        out[f"recall@{k}"] = (sums[2 * j] / sums[-1]).item()
        out[f"ndcg@{k}"] = (sums[2 * j + 1] / sums[-1]).item()
    return out


def main():
    args = get_args()
    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    g = torch.load(args.graph)
    nu, ni = g["num_users"], g["num_items"]
    train_ei, test_ei = g["train"].to(device), g["test"].to(device)
    edge_index = torch.stack([torch.cat([train_ei[0], train_ei[1] + nu]),
                              torch.cat([train_ei[1] + nu, train_ei[0]])])
    # popularity correction for in-batch negatives
    item_freq = degree(train_ei[1], ni).clamp(min=1)
    item_logq = (item_freq / item_freq.sum()).log()

    torch.manual_seed(42)
    model = DDP(Encoder(nu + ni, args.dim, args.layers).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    pairs = range(train_ei.size(1))
    sampler = DistributedSampler(pairs, shuffle=True, drop_last=True)
    loader = DataLoader(pairs, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        wandb.watch(model.module, log=None)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for idx in loader:
            idx = idx.to(device, non_blocking=True)
            u, i = train_ei[0, idx], train_ei[1, idx]
            emb = model(edge_index)
            loss = sampled_softmax_loss(emb[u], emb[nu + i], item_logq[i], args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sched.get_last_lr()[0]}, step=step)

        model.eval()
        metrics = topk_metrics(model, edge_index, train_ei, test_ei, nu, args.k, rank, world, device)
        if rank == 0:
            wandb.log({f"val/{k}": v for k, v in metrics.items()} | {"epoch": epoch}, step=step)
            print(f"epoch {epoch} {metrics} ({time.time() - t0:.0f}s)", flush=True)
            if metrics[f"ndcg@{args.k[0]}"] > best:
                best = metrics[f"ndcg@{args.k[0]}"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(args.ckpt_dir, "best.pt"))
                wandb.run.summary["best_ndcg"] = best

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
