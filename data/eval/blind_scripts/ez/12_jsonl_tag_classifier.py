#!/usr/bin/env python
"""fastText-style hashed n-gram tagger trained straight from the catalog export.

Input: jsonl lines {"sku": ..., "title": ..., "tags": ["apparel>shoes>running", ...]}.
Tags seen fewer than --min-tag-count times in train are dropped.

    torchrun --nproc_per_node=8 12_jsonl_tag_classifier.py \
        --train /mnt/shared/tagging/export_2024_05/train.jsonl \
        --test /mnt/shared/tagging/export_2024_05/test.jsonl --out /mnt/shared/tagging/runs/ft
"""
import argparse
import json
import os
import re
import time
import zlib
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z0-9]+")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--buckets", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=300)
    ap.add_argument("--min-tag-count", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--global-batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def featurize(title, buckets, max_tokens):
    """word unigrams + bigrams + char 3-grams, hashed with crc32 into `buckets` ids (0 = pad)."""
    words = TOKEN_RE.findall(title.lower())
    feats = words + [a + "_" + b for a, b in zip(words, words[1:])]
    for w in words:
        w = f"<{w}>"
        feats.extend(w[i:i + 3] for i in range(len(w) - 2))
    ids = [1 + zlib.crc32(f.encode()) % (buckets - 1) for f in feats][:max_tokens]
    out = np.zeros(max_tokens, dtype=np.int64)
    out[: len(ids)] = ids
    return out


class TagDataset(Dataset):
    def __init__(self, records, tag2id, buckets, max_tokens):
        self.titles = [r["title"] for r in records]
        self.tags = [[tag2id[t] for t in r["tags"] if t in tag2id] for r in records]
        self.buckets, self.max_tokens = buckets, max_tokens

    def __len__(self):
        return len(self.titles)

    def __getitem__(self, i):
        return torch.from_numpy(featurize(self.titles[i], self.buckets, self.max_tokens)), self.tags[i]


def collate(batch):
    x = torch.stack([b[0] for b in batch])
    rows = torch.cat([torch.full((len(b[1]),), i, dtype=torch.long) for i, b in enumerate(batch)])
    cols = torch.tensor([t for b in batch for t in b[1]], dtype=torch.long)
    return x, rows, cols


class FastTagger(nn.Module):
    def __init__(self, buckets, dim, num_tags):
        super().__init__()
        self.emb = nn.EmbeddingBag(buckets, dim, mode="mean", padding_idx=0)
        self.hidden = nn.Sequential(nn.Linear(dim, 1024), nn.GELU(), nn.LayerNorm(1024))
        self.out = nn.Linear(1024, num_tags)

    def forward(self, x):
        return self.out(self.hidden(self.emb(x)))


def to_dense(n, rows, cols, num_tags, device):
    t = torch.zeros(n, num_tags, device=device)
    t[rows.to(device), cols.to(device)] = 1.0
    return t


@torch.no_grad()
def evaluate(net, loader, num_tags, device, ks=(1, 3, 5)):
    net.eval()
    disc = 1.0 / torch.log2(torch.arange(2, max(ks) + 2, device=device).double())
    acc = torch.zeros(2 * len(ks) + 1, device=device, dtype=torch.float64)
    for x, rows, cols in loader:
        x = x.to(device)
        t = to_dense(x.size(0), rows, cols, num_tags, device)
        hit = t.gather(1, net(x).topk(max(ks), dim=1).indices).double()
        npos = t.sum(1).long()
        idcg = disc.cumsum(0)
        for j, k in enumerate(ks):
            acc[j] += hit[:, :k].sum() / k
            denom = idcg[(npos.clamp(max=k) - 1).clamp(min=0)]
            acc[len(ks) + j] += torch.where(npos > 0, (hit[:, :k] * disc[:k]).sum(1) / denom,
                                            torch.zeros_like(denom)).sum()
        acc[-1] += x.size(0)
    dist.all_reduce(acc)
    net.train()
    acc = (acc[:-1] / acc[-1]).tolist()
    return dict(zip([f"P@{k}" for k in ks] + [f"nDCG@{k}" for k in ks], acc))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_recs, test_recs = read_jsonl(args.train), read_jsonl(args.test)
    counts = Counter(t for r in train_recs for t in r["tags"])
    kept = {t for t, c in counts.items() if c >= args.min_tag_count}
    tag2id = {t: i for i, t in enumerate(kept)}
    num_tags = len(tag2id)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tag2id.json"), "w") as f:
            json.dump(tag2id, f)
        print(f"{len(train_recs)} train / {len(test_recs)} test products, {num_tags} tags", flush=True)

    train_ds = TagDataset(train_recs, tag2id, args.buckets, args.max_tokens)
    test_ds = TagDataset(test_recs, tag2id, args.buckets, args.max_tokens)
    test_ds = Subset(test_ds, range(rank, len(test_ds), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.global_batch_size // world, sampler=sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=2048, collate_fn=collate, num_workers=4)

    net = FastTagger(args.buckets, args.dim, num_tags).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.05)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (x, rows, cols) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            target = to_dense(x.size(0), rows, cols, num_tags, device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="sum") / x.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and step % 300 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        metrics = evaluate(net, test_loader, num_tags, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            if metrics["P@1"] > best:
                best = metrics["P@1"]
                torch.save({"model": net.state_dict(), "num_tags": num_tags, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
