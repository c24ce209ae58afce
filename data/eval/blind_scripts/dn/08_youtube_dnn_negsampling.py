"""YouTube-DNN style candidate generator: watch history -> next watched video.

Sampled softmax with popularity-based negatives (count^0.75) and logQ correction.

    torchrun --standalone --nproc_per_node=8 08_youtube_dnn_negsampling.py \
        --data /datasets/watchlog/v5 --num_neg 1024 --epochs 4
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("ytdnn")
PAD = 0


class PopularitySampler:
    """Draws negative item ids with probability proportional to count ** power."""

    def __init__(self, counts, device, power=0.75):
        p = torch.as_tensor(counts, dtype=torch.float64).clamp(min=1.0) ** power
        p[PAD] = 0.0
        self.probs = (p / p.sum()).float().to(device)
        self.log_q = torch.log(self.probs.clamp(min=1e-12))

    def sample(self, n):
        return torch.multinomial(self.probs, n, replacement=True)


class WatchSequences(Dataset):
    def __init__(self, path, max_len, neg_sampler=None, num_neg=0):
        t = pq.read_table(path, columns=["user_id", "history", "target", "age_bucket", "country"])
        hist = t.column("history").to_pylist()
        self.hist = np.full((len(hist), max_len), PAD, dtype=np.int64)
        for i, h in enumerate(hist):
            h = h[-max_len:]
            self.hist[i, max_len - len(h):] = h
        self.target = t.column("target").to_numpy().astype(np.int64)
        self.age = t.column("age_bucket").to_numpy().astype(np.int64)
        self.country = t.column("country").to_numpy().astype(np.int64)
        self.neg_sampler = neg_sampler
        self.num_neg = num_neg

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        item = {
            "hist": torch.from_numpy(self.hist[i]),
            "target": torch.tensor(self.target[i]),
            "age": torch.tensor(self.age[i]),
            "country": torch.tensor(self.country[i]),
        }
        if self.neg_sampler is not None:
            item["neg"] = self.neg_sampler.sample(self.num_neg)
        return item


class YouTubeDNN(nn.Module):
    def __init__(self, n_items, n_age, n_country, dim, hidden=(1024, 512)):
        super().__init__()
        self.item_emb = nn.Embedding(n_items, dim, padding_idx=PAD)
        self.age_emb = nn.Embedding(n_age, 8)
        self.country_emb = nn.Embedding(n_country, 16)
        layers, d = [], dim + 8 + 16
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, dim))
        self.user_mlp = nn.Sequential(*layers)
        # output (softmax) embeddings are separate from the input ones
        self.out_emb = nn.Embedding(n_items, dim)
        self.out_bias = nn.Embedding(n_items, 1)
        nn.init.normal_(self.out_emb.weight, std=1.0 / math.sqrt(dim))
        nn.init.zeros_(self.out_bias.weight)

    def user_vector(self, hist, age, country):
        mask = (hist != PAD).unsqueeze(-1).float()
        h = (self.item_emb(hist) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.user_mlp(torch.cat([h, self.age_emb(age), self.country_emb(country)], -1))

    def forward(self, hist, age, country, target, neg):
        u = self.user_vector(hist, age, country)                       # B x d
        pos = (u * self.out_emb(target)).sum(-1) + self.out_bias(target).squeeze(-1)
        neg_logits = u @ self.out_emb(neg).t() + self.out_bias(neg).squeeze(-1)  # B x N (shared negatives)
        return pos, neg_logits


def sampled_softmax_loss(pos, neg_logits, target, neg, log_q):
    pos = pos - log_q[target]
    neg_logits = neg_logits - log_q[neg].unsqueeze(0)
    neg_logits = neg_logits.masked_fill(neg.unsqueeze(0) == target.unsqueeze(1), -1e9)
    logits = torch.cat([pos.unsqueeze(1), neg_logits], 1)
    return F.cross_entropy(logits, torch.zeros(logits.size(0), dtype=torch.long, device=logits.device))


@torch.no_grad()
def hit_rate(net, loader, device, k=100):
    net.eval()
    table = net.out_emb.weight
    bias = net.out_bias.weight.squeeze(-1)
    hits = torch.zeros(2, device=device, dtype=torch.float64)
    for b in loader:
        u = net.user_vector(b["hist"].to(device), b["age"].to(device), b["country"].to(device))
        scores = u @ table.t() + bias
        scores[:, PAD] = -float("inf")
        topk = scores.topk(k, -1).indices
        hits[0] += (topk == b["target"].to(device).unsqueeze(1)).any(1).sum()
        hits[1] += topk.size(0)
    dist.all_reduce(hits)
    net.train()
    return (hits[0] / hits[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", default="/datasets/watchlog/ckpt/ytdnn")
    ap.add_argument("--n_items", type=int, default=2_000_000)
    ap.add_argument("--n_age", type=int, default=16)
    ap.add_argument("--n_country", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--max_len", type=int, default=64)
    ap.add_argument("--num_neg", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--num_workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(0)

    counts = np.load(os.path.join(args.data, "item_counts.npy"))
    neg_sampler = PopularitySampler(counts, device)

    train_ds = WatchSequences(os.path.join(args.data, "train.parquet"), args.max_len, neg_sampler, args.num_neg)
    val_ds = WatchSequences(os.path.join(args.data, "val.parquet"), args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=2048,
                            num_workers=args.num_workers, pin_memory=True)

    model = YouTubeDNN(args.n_items, args.n_age, args.n_country, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for b in train_loader:
            hist = b["hist"].to(device, non_blocking=True)
            target = b["target"].to(device, non_blocking=True)
            age = b["age"].to(device, non_blocking=True)
            country = b["country"].to(device, non_blocking=True)
            neg = b["neg"][0].to(device)  # one shared negative set per batch
            pos, neg_logits = model(hist, age, country, target, neg)
            loss = sampled_softmax_loss(pos, neg_logits, target, neg, neg_sampler.log_q)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f (%.1f ms/step)", epoch, step, l.item(),
                            (time.time() - t0) * 5)
                t0 = time.time()

        hr = hit_rate(model.module, val_loader, device)
        logger.info("epoch %d HR@100 %.4f", epoch, hr)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "hr100": hr},
                       os.path.join(args.ckpt_dir, f"ytdnn_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
