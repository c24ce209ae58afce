"""
Two-tower candidate retrieval model (home feed), trained with in-batch sampled softmax
with negatives gathered from all ranks and logQ correction.

Deployed through the ML platform's PyTorchJob template (2 workers x 8 A100-40G):

    cmd:  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
            --rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT) \
            two_tower.py --train /data/feed/2024-06/train/*.parquet \
            --eval /data/feed/2024-06/eval.parquet --items /data/feed/2024-06/items.parquet \
            --out /mnt/models/two_tower/2024-06

Metrics go to the team's wandb project (rank 0 only); checkpoints to the shared PVC.
"""
import argparse
import glob
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

HIST_LEN = 50


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--items", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-users", type=int, default=5_000_000, help="hashed user buckets")
    p.add_argument("--num-items", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--topk", type=int, default=100)
    return p.parse_args()


class Interactions(Dataset):
    def __init__(self, files):
        df = pd.concat([pd.read_parquet(f, columns=["user_id", "item_id", "hist", "item_logq"]) for f in files])
        self.user = df["user_id"].to_numpy(np.int64)
        self.item = df["item_id"].to_numpy(np.int64)
        self.logq = df["item_logq"].to_numpy(np.float32)
        self.hist = np.stack([np.pad(h[-HIST_LEN:], (HIST_LEN - len(h[-HIST_LEN:]), 0)) for h in df["hist"]]).astype(np.int64)

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        return self.user[i], self.hist[i], self.item[i], self.logq[i]


class Tower(nn.Module):
    def __init__(self, in_dim, dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_dim, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, dim))

    def forward(self, x):
        return F.normalize(self.mlp(x), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, dim):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, 64)
        self.item_emb = nn.Embedding(n_items + 1, 64, padding_idx=0)
        self.query = Tower(128, dim)
        self.cand = Tower(64, dim)

    def encode_query(self, user, hist):
        h = self.item_emb(hist)
        mask = (hist > 0).float().unsqueeze(-1)
        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.query(torch.cat([self.user_emb(user), pooled], dim=-1))

    def encode_item(self, item):
        return self.cand(self.item_emb(item))

    def forward(self, user, hist, item):
        return self.encode_query(user, hist), self.encode_item(item)


def sampled_softmax_loss(q, c, logq, temperature):
    # gather candidates from every rank so each query sees world_size * B negatives
    all_c = torch.cat(dist_fn.all_gather(c), dim=0)
    all_logq = torch.cat(dist_fn.all_gather(logq), dim=0)
    logits = q @ all_c.t() / temperature - all_logq[None, :]
    offset = dist.get_rank() * q.size(0)
    labels = torch.arange(q.size(0), device=q.device) + offset
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def recall_at_k(model, items_path, eval_loader, k, device):
    model.eval()
    net = model.module
    item_ids = torch.from_numpy(pd.read_parquet(items_path, columns=["item_id"])["item_id"].to_numpy(np.int64))
    cand = torch.cat([net.encode_item(chunk.to(device)) for chunk in item_ids.split(65536)])
    item_ids = item_ids.to(device)
    n_hit, n_q = 0, 0
    for user, hist, item, _ in eval_loader:
        q = net.encode_query(user.to(device), hist.to(device))
        top = (q @ cand.t()).topk(k, dim=1).indices
        n_hit += (item_ids[top] == item.to(device)[:, None]).any(1).sum().item()
        n_q += user.numel()
    counts = torch.tensor([n_hit, n_q], dtype=torch.float64)
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = Interactions(sorted(glob.glob(args.train)))
    eval_ds = Interactions([args.eval])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    eval_dl = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=512, num_workers=2)

    torch.manual_seed(7)
    model = TwoTower(args.num_users, args.num_items, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.05)

    if rank == 0:
        wandb.init(project="feed-retrieval", name=os.path.basename(args.out.rstrip("/")), config=vars(args))
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for user, hist, item, logq in train_dl:
            user, hist = user.to(device, non_blocking=True), hist.to(device, non_blocking=True)
            item, logq = item.to(device, non_blocking=True), logq.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, c = model(user, hist, item)
            loss = sampled_softmax_loss(q.float(), c.float(), logq, args.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0]}, step=step)

        recall = recall_at_k(model, args.items, eval_dl, args.topk, device)
        if rank == 0:
            wandb.log({f"eval/recall@{args.topk}": recall, "epoch": epoch}, step=step)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
