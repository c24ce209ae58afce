#!/usr/bin/env python
"""LightGCN for grocery re-order recommendations, preemptible queue version.

Writes last.pt every epoch and resumes from it automatically (same run id in W&B).
Older checkpoints from the first version of this script were saved from the DDP
wrapper and still carry the "module." prefix; they are accepted too.

    torchrun --nproc_per_node=8 lightgcn_reorder.py --graph /mnt/graphs/reorder/v3.pt \
        --run-dir /mnt/experiments/reorder/lgcn_d128
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.nn import LightGCN


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--micro-batch", type=int, default=2048)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--reg", type=float, default=1e-4)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--no-wandb", action="store_true")
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, msg_ei, train_ei, test_ei, nu, k, rank, world, device):
    emb = model.module.get_embedding(msg_ei)
    ue, ie = emb[:nu], emb[nu:]
    users = torch.unique(test_ei[0])[rank::world]
    disc = 1.0 / torch.log2(torch.arange(k, device=device).float() + 2.0)
    acc = torch.zeros(3, device=device)
    for chunk in users.split(2048):
        where = torch.full((nu,), -1, dtype=torch.long, device=device)
        where[chunk] = torch.arange(chunk.numel(), device=device)
        s = ue[chunk] @ ie.t()
        r = where[train_ei[0]]
        s[r[r >= 0], train_ei[1][r >= 0]] = float("-inf")
        t = torch.zeros_like(s, dtype=torch.bool)
        r = where[test_ei[0]]
        t[r[r >= 0], test_ei[1][r >= 0]] = True
        rel = t.gather(1, s.topk(k, 1).indices).float()
        n = t.sum(1).clamp(max=k)
        acc[0] += (rel.sum(1) / n).sum()
        acc[1] += ((rel * disc).sum(1) / disc.cumsum(0)[n - 1]).sum()
        acc[2] += chunk.numel()
    dist.all_reduce(acc)
    return {f"recall@{k}": (acc[0] / acc[2]).item(), f"ndcg@{k}": (acc[1] / acc[2]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    last_path = os.path.join(args.run_dir, "last.pt")

    g = torch.load(args.graph, map_location="cpu")
    nu, ni = g["num_users"], g["num_items"]
    train_ei, test_ei = g["train"].to(device), g["test"].to(device)
    msg_ei = torch.stack([torch.cat([train_ei[0], train_ei[1] + nu]),
                          torch.cat([train_ei[1] + nu, train_ei[0]])])

    torch.manual_seed(0)
    net = LightGCN(nu + ni, args.dim, args.layers)
    opt_state, start_epoch, best, run_id = None, 0, 0.0, None
    if os.path.exists(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        state = ckpt["model"]
        consume_prefix_in_state_dict_if_present(state, "module.")
        net.load_state_dict(state)
        opt_state = ckpt.get("opt")
        start_epoch, best, run_id = ckpt["epoch"] + 1, ckpt["best"], ckpt.get("wandb_id")
    model = DDP(net.to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)
    use_wandb = rank == 0 and not args.no_wandb
    if use_wandb:
        run = wandb.init(project="reorder-graph", id=run_id, resume="allow", config=vars(args),
                         dir=args.run_dir)
        run_id = run.id
    # everyone keeps the same id so whichever rank 0 writes last.pt next time has it
    holder = [run_id]
    dist.broadcast_object_list(holder, src=0)
    run_id = holder[0]

    pairs = range(train_ei.size(1))
    sampler = DistributedSampler(pairs, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(pairs, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    if rank == 0:
        print(f"start at epoch {start_epoch} | global batch {args.micro_batch * args.accum * world}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        opt.zero_grad(set_to_none=True)
        for step, idx in enumerate(loader):
            idx = idx.to(device, non_blocking=True)
            u, i = train_ei[0, idx], train_ei[1, idx]
            j = torch.randint(0, ni, (idx.numel(),), device=device)
            eli = torch.stack([torch.cat([u, u]), torch.cat([i, j]) + nu])
            last_micro = (step + 1) % args.accum == 0
            ctx = model.no_sync() if not last_micro else torch.enable_grad()
            with ctx:
                pos_rank, neg_rank = model(msg_ei, eli).chunk(2)
                loss = F.softplus(neg_rank - pos_rank).mean()
                loss = loss + args.reg * model.module.embedding(eli.unique()).pow(2).sum() / idx.numel()
                (loss / args.accum).backward()
            if last_micro:
                opt.step()
                opt.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        metrics = evaluate(model, msg_ei, train_ei, test_ei, nu, args.k, rank, world, device)
        metrics["loss"] = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"epoch {epoch} {json.dumps(metrics)} ({time.time() - t0:.0f}s)", flush=True)
            if use_wandb:
                wandb.log(metrics, step=epoch)
            if metrics[f"ndcg@{args.k}"] > best:
                best = metrics[f"ndcg@{args.k}"]
                torch.save(model.module.state_dict(), os.path.join(args.run_dir, "best.pt"))
            tmp = last_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "best": best, "wandb_id": run_id}, tmp)
            os.replace(tmp, last_path)
        dist.barrier()

    if use_wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
