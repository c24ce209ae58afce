"""Two-tower retrieval model (user tower / item tower) trained with in-batch sampled softmax.

Item popularity logQ correction, negatives shared across all GPUs, Recall@K / NDCG@K on the
held-out next item of every user.

    torchrun --standalone --nproc_per_node=8 05_two_tower_recall.py --data /data/ml-25m/processed \
        --out runs/two_tower_ml25m
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--hist-len", type=int, default=50)
    ap.add_argument("--global-batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--topk", type=int, nargs="+", default=[10, 50, 100])
    return ap.parse_args()


class InteractionData(Dataset):
    """(user, history[hist_len], target item) triples, built offline by prepare_ml.py."""

    def __init__(self, path):
        arr = np.load(path)
        self.users = torch.from_numpy(arr["users"]).long()
        self.hist = torch.from_numpy(arr["hist"]).long()      # 0 = padding
        self.target = torch.from_numpy(arr["target"]).long()

    def __len__(self):
        return len(self.users)

    def __getitem__(self, i):
        return self.users[i], self.hist[i], self.target[i]


class UserTower(nn.Module):
    def __init__(self, n_users, n_items, dim):
        super().__init__()
        self.user_emb = nn.Embedding(n_users, dim)
        self.hist_emb = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 512), nn.ReLU(), nn.Linear(512, dim))

    def forward(self, users, hist):
        mask = (hist > 0).float().unsqueeze(-1)
        h = (self.hist_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return F.normalize(self.mlp(torch.cat([self.user_emb(users), h], dim=-1)), dim=-1)


class ItemTower(nn.Module):
    def __init__(self, n_items, n_genres, dim, item_genres):
        super().__init__()
        self.item_emb = nn.Embedding(n_items + 1, dim, padding_idx=0)
        self.genre_emb = nn.EmbeddingBag(n_genres, dim, mode="mean")
        self.register_buffer("item_genres", item_genres, persistent=False)  # [n_items+1, 4]
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 512), nn.ReLU(), nn.Linear(512, dim))

    def forward(self, items):
        g = self.genre_emb(self.item_genres[items])
        return F.normalize(self.mlp(torch.cat([self.item_emb(items), g], dim=-1)), dim=-1)


class TwoTower(nn.Module):
    def __init__(self, n_users, n_items, n_genres, dim, item_genres):
        super().__init__()
        self.user_tower = UserTower(n_users, n_items, dim)
        self.item_tower = ItemTower(n_items, n_genres, dim, item_genres)

    def forward(self, users, hist, items):
        return self.user_tower(users, hist), self.item_tower(items)


def all_gather_nograd(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def inbatch_softmax_loss(u, v, items, log_q, temperature):
    """Sampled softmax where the candidates are the positives of the whole global batch."""
    rank = dist.get_rank()
    vs = all_gather_nograd(v.detach())
    vs[rank] = v
    all_v = torch.cat(vs)
    all_items = torch.cat(all_gather_nograd(items))
    logits = u @ all_v.t() / temperature - log_q[all_items].unsqueeze(0)
    # the same item can appear several times in the global batch: mask the accidental hits
    labels = torch.arange(u.size(0), device=u.device) + rank * u.size(0)
    accidental = (items.unsqueeze(1) == all_items.unsqueeze(0))
    accidental[torch.arange(u.size(0)), labels] = False
    logits = logits.masked_fill(accidental, -1e4)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def evaluate(model, loader, n_items, topk, device):
    model.eval()
    net = model.module
    all_items = torch.arange(0, n_items + 1, device=device)
    item_vecs = torch.cat([net.item_tower(chunk) for chunk in all_items.split(65536)])
    hits = {k: 0.0 for k in topk}
    ndcg = {k: 0.0 for k in topk}
    n = 0
    for users, hist, target in loader:
        users, hist, target = users.to(device), hist.to(device), target.to(device)
        u = net.user_tower(users, hist)
        scores = u @ item_vecs.t()
        scores[:, 0] = -1e4                    # padding row
        scores.scatter_(1, hist, -1e4)         # do not recommend history
        top = scores.topk(max(topk), dim=1).indices
        match = top == target.unsqueeze(1)
        for k in topk:
            m = match[:, :k]
            hits[k] += m.any(1).float().sum().item()
            pos = m.float().argmax(1)
            ndcg[k] += (m.any(1).float() / torch.log2(pos.float() + 2)).sum().item()
        n += users.size(0)
    model.train()
    return {f"recall@{k}": hits[k] / n for k in topk} | {f"ndcg@{k}": ndcg[k] / n for k in topk}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    item_genres = torch.from_numpy(np.load(os.path.join(args.data, "item_genres.npy"))).long()
    item_counts = torch.from_numpy(np.load(os.path.join(args.data, "item_counts.npy"))).float()
    log_q = torch.log((item_counts + 1) / (item_counts + 1).sum()).to(device)

    train_ds = InteractionData(os.path.join(args.data, "train.npz"))
    val_ds = InteractionData(os.path.join(args.data, "val.npz"))
    per_gpu = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=2048, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=4, pin_memory=True)

    model = TwoTower(meta["n_users"], meta["n_items"], meta["n_genres"], args.dim, item_genres).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total = len(train_dl) * args.epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.05)

    os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros((), device=device)
        for step, (users, hist, items) in enumerate(train_dl):
            users, hist, items = users.to(device), hist.to(device), items.to(device)
            u, v = model(users, hist, items)
            loss = inbatch_softmax_loss(u, v, items, log_q, args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.detach()
            if (step + 1) % 200 == 0:
                dist.all_reduce(running, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step + 1}/{len(train_dl)} loss {running.item() / 200:.4f}",
                          flush=True)
                running.zero_()

        metrics = evaluate(model, val_dl, meta["n_items"], args.topk, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): "
                  + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.out, "last.pt"))
            if metrics["recall@50"] > best:
                best = metrics["recall@50"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
