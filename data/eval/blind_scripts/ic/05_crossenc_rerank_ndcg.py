#!/usr/bin/env python
"""Cross-encoder reranker (query, product) -> relevance score.

Trained listwise: every training example is one query with 1 relevant product and
`group_size - 1` candidates from the first-stage retriever, softmax CE over the group.
Dev: rerank the retriever's top-k per query, NDCG@10 with ESCI gains (E=3, S=2, C=1, I=0).

torchrun --nproc_per_node=4 05_crossenc_rerank_ndcg.py --train data/rerank/train.jsonl \
    --dev data/rerank/dev.jsonl --output_dir out/ce-minilm
"""
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)
GAIN = {"E": 3, "S": 2, "C": 1, "I": 0}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model_name", default="cross-encoder/ms-marco-MiniLM-L-12-v2")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--per_device_groups", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--num_epochs", type=int, default=3)
    p.add_argument("--max_len", type=int, default=160)
    p.add_argument("--eval_every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class GroupDataset(Dataset):
    """jsonl rows: {"qid", "query", "candidates": [{"pid", "text", "esci"}...]}"""

    def __init__(self, path, group_size):
        self.group_size = group_size
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                pos = [c for c in r["candidates"] if c["esci"] == "E"]
                neg = [c for c in r["candidates"] if c["esci"] in ("I", "C")]
                if pos and neg:
                    self.rows.append((r["query"], pos, neg))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        query, pos, neg = self.rows[i]
        k = self.group_size - 1
        negs = random.sample(neg, k) if len(neg) >= k else random.choices(neg, k=k)
        return query, [random.choice(pos)["text"]] + [n["text"] for n in negs]


def load_dev(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def ndcg_at_k(gains_in_rank_order, all_gains, k=10):
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    g = np.asarray(gains_in_rank_order[:k], dtype=np.float64)
    dcg = ((2 ** g - 1) * disc[: len(g)]).sum()
    ideal = np.sort(np.asarray(all_gains, dtype=np.float64))[::-1][:k]
    idcg = ((2 ** ideal - 1) * disc[: len(ideal)]).sum()
    return dcg / idcg if idcg > 0 else 0.0


@torch.no_grad()
def evaluate(model, tok, dev_rows, args, device, rank, world):
    model.eval()
    ndcg_sum, mrr_sum, n = 0.0, 0.0, 0
    for row in dev_rows[rank::world]:
        texts = [c["text"] for c in row["candidates"]]
        enc = tok([row["query"]] * len(texts), texts, padding=True, truncation="only_second",
                  max_length=args.max_len, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = model(**enc).logits.squeeze(-1).float().cpu().numpy()
        order = np.argsort(-scores)
        gains = [GAIN[row["candidates"][j]["esci"]] for j in order]
        ndcg_sum += ndcg_at_k(gains, gains)
        first = next((r for r, g in enumerate(gains[:10]) if g == 3), None)
        mrr_sum += 0.0 if first is None else 1.0 / (first + 1)
        n += 1
    stats = torch.tensor([ndcg_sum, mrr_sum, n], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=1).to(device)
    ddp = DDP(model, device_ids=[local_rank])

    train_ds = GroupDataset(args.train, args.group_size)
    dev_rows = load_dev(args.dev)
    log.info("train groups: %d  dev queries: %d  world size: %d", len(train_ds), len(dev_rows), world)

    def collate(batch):
        queries, groups = [], []
        for q, docs in batch:
            queries += [q] * len(docs)
            groups += docs
        return tok(queries, groups, padding=True, truncation="only_second",
                   max_length=args.max_len, return_tensors="pt")

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.per_device_groups, sampler=sampler,
                        collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)

    no_decay = ("bias", "LayerNorm.weight")
    params = [
        {"params": [p for n, p in ddp.named_parameters() if not any(x in n for x in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in ddp.named_parameters() if any(x in n for x in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(params, lr=args.lr)
    total_steps = len(loader) * args.num_epochs
    sched = get_linear_schedule_with_warmup(opt, math.ceil(0.1 * total_steps), total_steps)

    best, step = -1.0, 0
    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(**batch).logits.view(-1, args.group_size).float()
            target = torch.zeros(logits.size(0), dtype=torch.long, device=device)
            loss = F.cross_entropy(logits, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())
            if step % args.eval_every == 0:
                ndcg, mrr = evaluate(model, tok, dev_rows, args, device, rank, world)
                log.info("step %d  dev NDCG@10 %.4f  MRR@10 %.4f", step, ndcg, mrr)
                if rank == 0 and ndcg > best:
                    best = ndcg
                    model.save_pretrained(os.path.join(args.output_dir, "best"))
                    tok.save_pretrained(os.path.join(args.output_dir, "best"))
                dist.barrier()

    ndcg, mrr = evaluate(model, tok, dev_rows, args, device, rank, world)
    log.info("final dev NDCG@10 %.4f  MRR@10 %.4f (best %.4f)", ndcg, mrr, max(best, ndcg))
    if rank == 0:
        model.save_pretrained(os.path.join(args.output_dir, "final"))
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
