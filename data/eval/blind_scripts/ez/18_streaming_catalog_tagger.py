#!/usr/bin/env python
"""Tagger trained directly on the daily catalog dump (part-*.jsonl.gz, ~300 parts,
~2.5B product/tag pairs) without materialising it: every GPU streams its own
parts, every DataLoader worker a subset of those.

    torchrun --nproc_per_node=8 18_streaming_catalog_tagger.py \
        --train-glob '/mnt/shared/catalog_dump/2024-06-01/train/part-*.jsonl.gz' \
        --test /mnt/shared/catalog_dump/2024-06-01/test.jsonl --num-tags 1048576
"""
import argparse
import glob
import gzip
import json
import os
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-glob", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--num-tags", type=int, required=True)
    ap.add_argument("--out", default="/mnt/shared/tagging/runs/stream")
    ap.add_argument("--buckets", type=int, default=8_388_608)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--max-feats", type=int, default=64)
    ap.add_argument("--max-pos", type=int, default=16)
    ap.add_argument("--num-neg", type=int, default=32768)
    ap.add_argument("--global-batch-size", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def hash_feats(text, buckets, max_feats):
    toks = text.lower().split()
    feats = toks + [a + " " + b for a, b in zip(toks, toks[1:])]
    ids = np.zeros(max_feats, dtype=np.int64)
    h = [1 + zlib.crc32(t.encode()) % (buckets - 1) for t in feats[:max_feats]]
    ids[: len(h)] = h
    return ids


def encode_record(rec, buckets, max_feats, max_pos):
    pos = np.full(max_pos, -1, dtype=np.int64)
    tags = rec["tag_ids"][:max_pos]
    pos[: len(tags)] = tags
    return hash_feats(rec["title"] + " " + rec.get("category_path", ""), buckets, max_feats), pos


class CatalogStream(IterableDataset):
    def __init__(self, files, buckets, max_feats, max_pos, seed=0):
        self.files, self.buckets, self.max_feats, self.max_pos = files, buckets, max_feats, max_pos
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        rng = np.random.default_rng(self.seed + self.epoch)
        files = [files[i] for i in rng.permutation(len(files))]
        for path in files:
            with gzip.open(path, "rt") as f:
                for line in f:
                    rec = json.loads(line)
                    if not rec.get("tag_ids"):
                        continue
                    x, pos = encode_record(rec, self.buckets, self.max_feats, self.max_pos)
                    yield torch.from_numpy(x), torch.from_numpy(pos)


class StreamTagger(nn.Module):
    def __init__(self, buckets, dim, num_tags):
        super().__init__()
        self.emb = nn.EmbeddingBag(buckets, dim, mode="mean", padding_idx=0)
        self.proj = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.tag = nn.Embedding(num_tags, dim)
        nn.init.normal_(self.tag.weight, std=0.05)

    def encode(self, x):
        return self.proj(self.emb(x))

    def forward(self, x, cand):
        return self.encode(x) @ self.tag(cand).t()


@torch.no_grad()
def evaluate(net, X, P, rank, world, device, k=5):
    net.eval()
    rows = np.arange(rank, len(X), world)
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    W = net.tag.weight
    for s in range(0, len(rows), 4096):
        r = rows[s:s + 4096]
        x, pos = torch.from_numpy(X[r]).to(device), torch.from_numpy(P[r]).to(device)
        top = (net.encode(x) @ W.t()).topk(k, dim=1).indices
        hit = (top.unsqueeze(-1) == pos.unsqueeze(1)).any(-1).double()
        acc[0] += hit[:, 0].sum()
        acc[1] += hit.mean(1).sum()
        acc[2] += len(r)
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(args.train_glob))
    my_files = files[rank::world]
    stream = CatalogStream(my_files, args.buckets, args.max_feats, args.max_pos)
    per_gpu = args.global_batch_size // world
    loader = DataLoader(stream, batch_size=per_gpu, num_workers=args.workers,
                        pin_memory=True, drop_last=True, prefetch_factor=4)

    test_X, test_P = [], []
    with open(args.test) as f:
        for line in f:
            x, pos = encode_record(json.loads(line), args.buckets, args.max_feats, args.max_pos)
            test_X.append(x)
            test_P.append(pos)
    test_X, test_P = np.stack(test_X), np.stack(test_P)

    net = StreamTagger(args.buckets, args.dim, args.num_tags).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(files)} parts, {len(my_files)} on rank 0", flush=True)

    step = 0
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        t0, epoch_steps = time.time(), 0
        for x, pos in loader:
            x, pos = x.to(device, non_blocking=True), pos.to(device, non_blocking=True)
            valid = pos >= 0
            neg = torch.randint(0, args.num_tags, (args.num_neg,), device=device)
            cand = torch.unique(torch.cat([pos[valid], neg]))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, cand)
            target = torch.zeros(logits.shape, device=device)
            target.scatter_add_(1, torch.searchsorted(cand, pos.clamp(min=0)), valid.float())
            loss = F.binary_cross_entropy_with_logits(logits.float(), target.clamp(max=1.0),
                                                      reduction="sum") / x.size(0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            epoch_steps += 1
            if rank == 0 and step % 1000 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"{epoch_steps * per_gpu * world / (time.time() - t0):.0f} docs/s", flush=True)

        p1, p5 = evaluate(net, test_X, test_P, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} P@1 {p1:.4f} P@5 {p5:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, "stream_tagger.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
