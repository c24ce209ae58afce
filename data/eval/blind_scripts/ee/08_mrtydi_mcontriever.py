#!/usr/bin/env python
# Fine-tune mContriever on Mr. TyDi (one language at a time) with BM25 hard negatives.
# In-batch negatives are shared across GPUs. Eval on the dev split against the language's
# dev corpus subset (positives + BM25 top-100 of every dev query), MRR@100 and R@100.
#
#   torchrun --standalone --nproc_per_node=4 08_mrtydi_mcontriever.py --lang swahili --out out/sw
import argparse
import json
import logging
import os
import random
import time

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("mrtydi")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lang", default="swahili")
    ap.add_argument("--model", default="facebook/mcontriever-msmarco")
    ap.add_argument("--dev_pool", default=None, help="jsonl of docids to index for dev (default: data/<lang>/dev_pool.jsonl)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bsz", type=int, default=32)
    ap.add_argument("--negs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--temp", type=float, default=0.05)
    ap.add_argument("--max_q", type=int, default=64)
    ap.add_argument("--max_p", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class TrainSet(Dataset):
    def __init__(self, hf_split, negs):
        self.rows = [r for r in hf_split if r["positive_passages"] and r["negative_passages"]]
        self.negs = negs

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pos = random.choice(r["positive_passages"])
        pool = r["negative_passages"]
        negs = random.sample(pool, self.negs) if len(pool) >= self.negs else random.choices(pool, k=self.negs)
        fmt = lambda p: (p["title"] + " " + p["text"]).strip()
        return r["query"], [fmt(pos)] + [fmt(n) for n in negs]


class Contriever(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)

    @staticmethod
    def _mean(last_hidden, mask):
        last_hidden = last_hidden.masked_fill(~mask[..., None].bool(), 0.0)
        return last_hidden.sum(1) / mask.sum(1)[..., None]

    def encode_queries(self, ids, mask):
        return self._mean(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    def encode_passages(self, ids, mask):
        return self._mean(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    def forward(self, q_ids, q_mask, p_ids, p_mask):
        return self.encode_queries(q_ids, q_mask), self.encode_passages(p_ids, p_mask)


def gather_nograd_except_local(x):
    xs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x.contiguous())
    xs[dist.get_rank()] = x
    return torch.cat(xs)


@torch.no_grad()
def run_encoder(fn, tok, texts, max_len, device, bs=256):
    res = []
    for i in range(0, len(texts), bs):
        enc = tok(texts[i:i + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt")
        with torch.autocast("cuda", dtype=torch.float16):
            res.append(fn(enc["input_ids"].to(device), enc["attention_mask"].to(device)).float().cpu())
    return torch.cat(res).numpy() if res else np.zeros((0, 768), dtype=np.float32)


def evaluate(model, tok, args, dev, corpus, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    pool = sorted(corpus)
    my = pool[rank::world]
    p_emb = run_encoder(model.encode_passages, tok, [corpus[d] for d in my], args.max_p, device)
    gathered = [None] * world
    dist.all_gather_object(gathered, (my, p_emb))

    metrics = {}
    if rank == 0:
        docids = [d for ids, _ in gathered for d in ids]
        emb = np.concatenate([e for _, e in gathered]).astype("float32")
        index = faiss.IndexFlatIP(emb.shape[1])
        index.add(emb)
        q_emb = run_encoder(model.encode_queries, tok, [r["query"] for r in dev], args.max_q, device)
        _, I = index.search(q_emb.astype("float32"), 100)
        mrr, rec = 0.0, 0.0
        for r, row in zip(dev, I):
            gold = {p["docid"] for p in r["positive_passages"]}
            ranked = [docids[j] for j in row]
            for k, d in enumerate(ranked):
                if d in gold:
                    mrr += 1.0 / (k + 1)
                    break
            rec += len(gold & set(ranked)) / len(gold)
        metrics = {"MRR@100": mrr / len(dev), "R@100": rec / len(dev)}
    dist.barrier()
    model.train()
    return metrics


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    random.seed(args.seed + rank)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # rank 0 downloads/prepares the dataset cache first, the others then read it
    if rank == 0:
        mrtydi = load_dataset("castorini/mr-tydi", args.lang)
    dist.barrier()
    if rank != 0:
        mrtydi = load_dataset("castorini/mr-tydi", args.lang)
    train = TrainSet(mrtydi["train"], args.negs)
    dev = [r for r in mrtydi["dev"] if r["positive_passages"]]
    pool_path = args.dev_pool or os.path.join("data", args.lang, "dev_pool.jsonl")
    corpus = {}
    with open(pool_path) as f:
        for line in f:
            d = json.loads(line)
            corpus[d["docid"]] = (d["title"] + " " + d["text"]).strip()

    tok = AutoTokenizer.from_pretrained(args.model)

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=args.max_q, truncation=True, padding=True, return_tensors="pt")
        p = tok([x for b in batch for x in b[1]], max_length=args.max_p, truncation=True, padding=True,
                return_tensors="pt")
        return q["input_ids"], q["attention_mask"], p["input_ids"], p["attention_mask"]

    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=4,
                        drop_last=True)

    model = DDP(Contriever(args.model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total), total)
    scaler = torch.cuda.amp.GradScaler()
    group = args.negs + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("lang=%s train=%d dev=%d pool=%d world=%d", args.lang, len(train), len(dev), len(corpus), world)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for step, (qi, qm, pi, pm) in enumerate(loader):
            qi, qm, pi, pm = qi.to(device), qm.to(device), pi.to(device), pm.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                q, p = model(qi, qm, pi, pm)
            q = gather_nograd_except_local(q.float())
            p = gather_nograd_except_local(p.float())
            sim = q @ p.T / args.temp
            target = torch.arange(q.size(0), device=device) * group
            loss = F.cross_entropy(sim, target) * world

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f (%.0fs)", epoch, step, len(loader),
                            loss.item() / world, time.time() - start)

        metrics = evaluate(model, tok, args, dev, corpus, device)
        if rank == 0:
            logger.info("epoch %d dev %s", epoch, metrics)
            if metrics["MRR@100"] > best:
                best = metrics["MRR@100"]
                model.module.encoder.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "best_metrics.json"), "w") as f:
                    json.dump({"epoch": epoch, **metrics}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
