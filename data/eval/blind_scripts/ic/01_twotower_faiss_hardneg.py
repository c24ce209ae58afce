#!/usr/bin/env python
"""Two-tower product retrieval with ANN hard negatives.

Query tower and product tower share one MiniLM encoder (mean pooling).  At the
start of every epoch the whole catalog is re-encoded with the current weights,
a FAISS inner-product index is rebuilt, and hard negatives are mined for each
training query from ranks [hn_lo, hn_hi) of the index, skipping anything that
was clicked or bought for that query.

Data layout (prepared by the click-log ETL job):
    queries.parquet   query_id, query, split   (split is query-level: train/dev)
    products.parquet  product_id, title, brand, category
    qrels.parquet     query_id, product_id, clicks, orders
"""
import argparse
import logging
import math
import os
import random
import time
from collections import defaultdict

import faiss
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("twotower")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    p.add_argument("--out", default="/mnt/shared/ckpt/twotower_hn")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=128, help="queries per GPU")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--max_q_len", type=int, default=32)
    p.add_argument("--max_p_len", type=int, default=96)
    p.add_argument("--hn_lo", type=int, default=20)
    p.add_argument("--hn_hi", type=int, default=100)
    p.add_argument("--encode_bs", type=int, default=1024)
    p.add_argument("--seed", type=int, default=13)
    return p.parse_args()


def product_text(row):
    return f"{row.title} | {row.brand} | {row.category}"


class TrainPairs(Dataset):
    """One example per (query, relevant product); a hard negative is drawn per item."""

    def __init__(self, pairs, query_text, prod_text, hard_negs, all_pids):
        self.pairs = pairs
        self.query_text = query_text
        self.prod_text = prod_text
        self.hard_negs = hard_negs
        self.all_pids = all_pids

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        qid, pid = self.pairs[i]
        cands = self.hard_negs.get(qid)
        neg = random.choice(cands) if cands else random.choice(self.all_pids)
        return self.query_text[qid], self.prod_text[pid], self.prod_text[neg]


class Collator:
    def __init__(self, tok, max_q, max_p):
        self.tok, self.max_q, self.max_p = tok, max_q, max_p

    def __call__(self, batch):
        qs, ps, ns = zip(*batch)
        q = self.tok(list(qs), padding=True, truncation=True, max_length=self.max_q, return_tensors="pt")
        p = self.tok(list(ps) + list(ns), padding=True, truncation=True, max_length=self.max_p, return_tensors="pt")
        return q, p


class TwoTower(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)

    @property
    def dim(self):
        return self.encoder.config.hidden_size

    def encode(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-6)
        return F.normalize(emb, dim=-1)

    def forward(self, q, p):
        return self.encode(q["input_ids"], q["attention_mask"]), self.encode(p["input_ids"], p["attention_mask"])


@torch.no_grad()
def encode_texts(model, tok, texts, max_len, bs, device):
    model.eval()
    out = [torch.empty(0, model.dim, device=device)]
    for i in range(0, len(texts), bs):
        enc = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(model.encode(enc["input_ids"], enc["attention_mask"]).float())
    return torch.cat(out)


def encode_catalog(model, tok, texts, args, device, rank, world):
    """Each rank encodes a contiguous block; blocks are padded to equal size for all_gather."""
    per_rank = math.ceil(len(texts) / world)
    block = texts[rank * per_rank:(rank + 1) * per_rank]
    emb = encode_texts(model, tok, block, args.max_p_len, args.encode_bs, device)
    if emb.shape[0] < per_rank:
        emb = torch.cat([emb, emb.new_zeros(per_rank - emb.shape[0], emb.shape[1])])
    gathered = [torch.empty_like(emb) for _ in range(world)]
    dist.all_gather(gathered, emb)
    return torch.cat(gathered)[: len(texts)]


def build_index(p_emb):
    cpu_index = faiss.IndexFlatIP(p_emb.shape[1])
    res = faiss.StandardGpuResources()
    index = faiss.index_cpu_to_gpu(res, 0, cpu_index)
    index.add(p_emb)
    return index, res


def mine_hard_negatives(model, tok, index, pids, qids, query_text, positives, args, device, rank, world):
    mine_qids = qids[rank::world]
    q_emb = encode_texts(model, tok, [query_text[q] for q in mine_qids], args.max_q_len, args.encode_bs, device)
    _, nn_idx = index.search(q_emb.cpu().numpy(), args.hn_hi)
    mined = {}
    for qid, row in zip(mine_qids, nn_idx):
        pos = positives[qid]
        mined[qid] = [pids[j] for j in row[args.hn_lo:] if j >= 0 and pids[j] not in pos]
    parts = [None] * world
    dist.all_gather_object(parts, mined)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def evaluate(model, tok, index, pids, dev_qids, query_text, positives, args, device, rank, world):
    my_qids = dev_qids[rank::world]
    q_emb = encode_texts(model, tok, [query_text[q] for q in my_qids], args.max_q_len, args.encode_bs, device)
    stats = torch.zeros(3, device=device, dtype=torch.float64)  # mrr@10, recall@100, n
    if len(my_qids):
        _, nn_idx = index.search(q_emb.cpu().numpy(), 100)
        for qid, row in zip(my_qids, nn_idx):
            pos = positives[qid]
            ranked = [pids[j] for j in row if j >= 0]
            for r, pid in enumerate(ranked[:10]):
                if pid in pos:
                    stats[0] += 1.0 / (r + 1)
                    break
            stats[1] += len(pos.intersection(ranked)) / len(pos)
            stats[2] += 1
    dist.all_reduce(stats)
    n = stats[2].clamp(min=1)
    return (stats[0] / n).item(), (stats[1] / n).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(name)s] %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    queries = pd.read_parquet(os.path.join(args.data, "queries.parquet"))
    products = pd.read_parquet(os.path.join(args.data, "products.parquet"))
    qrels = pd.read_parquet(os.path.join(args.data, "qrels.parquet"))
    query_text = dict(zip(queries.query_id, queries["query"]))
    pids = products.product_id.tolist()
    prod_text = {pid: product_text(r) for pid, r in zip(pids, products.itertuples())}
    prod_texts = [prod_text[p] for p in pids]

    positives = defaultdict(set)
    for qid, pid in zip(qrels.query_id, qrels.product_id):
        positives[qid].add(pid)
    split = dict(zip(queries.query_id, queries.split))
    train_qids = sorted(q for q in positives if split.get(q) == "train")
    dev_qids = sorted(q for q in positives if split.get(q) == "dev")
    pairs = [(q, p) for q in train_qids for p in sorted(positives[q])]
    logger.info("train queries %d, pairs %d, dev queries %d, catalog %d",
                len(train_qids), len(pairs), len(dev_qids), len(pids))

    tok = AutoTokenizer.from_pretrained(args.model)
    model = TwoTower(args.model).to(device)
    ddp_model = DDP(model, device_ids=[local_rank])
    collate = Collator(tok, args.max_q_len, args.max_p_len)

    hard_negs = {}
    dataset = TrainPairs(pairs, query_text, prod_text, hard_negs, pids)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        collate_fn=collate, pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total), total)
    os.makedirs(args.out, exist_ok=True)
    best_mrr = -1.0

    for epoch in range(args.epochs):
        t0 = time.time()
        if epoch > 0:
            p_emb = encode_catalog(model, tok, prod_texts, args, device, rank, world)
            index, _res = build_index(p_emb.cpu().numpy())
            hard_negs.clear()
            hard_negs.update(mine_hard_negatives(model, tok, index, pids, train_qids, query_text,
                                                 positives, args, device, rank, world))
            del index, _res
            logger.info("epoch %d: mined negatives for %d queries in %.0fs", epoch, len(hard_negs), time.time() - t0)

        ddp_model.train()
        sampler.set_epoch(epoch)
        for step, (q, p) in enumerate(loader):
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            p = {k: v.to(device, non_blocking=True) for k, v in p.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q_emb, p_emb_b = ddp_model(q, p)
            scores = q_emb.float() @ p_emb_b.float().T / args.temperature
            labels = torch.arange(q_emb.size(0), device=device)
            loss = F.cross_entropy(scores, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(loader),
                            loss.item(), scheduler.get_last_lr()[0])

        p_emb = encode_catalog(model, tok, prod_texts, args, device, rank, world)
        index, _res = build_index(p_emb.cpu().numpy())
        mrr, recall = evaluate(model, tok, index, pids, dev_qids, query_text, positives, args, device, rank, world)
        del index, _res
        logger.info("epoch %d dev MRR@10 %.4f R@100 %.4f (%.0fs)", epoch, mrr, recall, time.time() - t0)

        if rank == 0:
            state = {"model": model.state_dict(), "epoch": epoch, "mrr": mrr, "args": vars(args)}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if mrr > best_mrr:
                torch.save(state, os.path.join(args.out, "best.pt"))
        best_mrr = max(best_mrr, mrr)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
