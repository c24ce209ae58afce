#!/usr/bin/env python
"""DPR-style bi-encoder on MS MARCO passage with BM25 hard negatives.

Separate query / passage towers (bert-base), in-batch + hard negatives shared
across all ranks. Dev eval = exact FAISS search over the dev rerank pool.
"""
import argparse
import json
import logging
import math
import os
import random
import time
from collections import defaultdict

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("dpr")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model_name", default="bert-base-uncased")
    p.add_argument("--train_file", required=True)
    p.add_argument("--dev_queries", required=True)
    p.add_argument("--dev_qrels", required=True)
    p.add_argument("--dev_corpus", required=True, help="tsv: pid \\t title \\t text (dev pool only)")
    p.add_argument("--output_dir", default="runs/dpr")
    p.add_argument("--per_device_batch_size", type=int, default=32)
    p.add_argument("--hard_negatives", type=int, default=1)
    p.add_argument("--q_max_len", type=int, default=32)
    p.add_argument("--p_max_len", type=int, default=156)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_ratio", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--eval_batch_size", type=int, default=256)
    return p.parse_args()


def fmt_passage(p):
    title = p.get("title") or ""
    return f"{title} [SEP] {p['text']}" if title else p["text"]


class TrainDataset(Dataset):
    def __init__(self, path, n_neg, seed):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                if not ex["positive_passages"] or not ex["negative_passages"]:
                    continue
                self.rows.append(ex)
        self.n_neg = n_neg
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        ex = self.rows[idx]
        rng = random.Random(self.seed + self.epoch * 1_000_003 + idx)
        pos = rng.choice(ex["positive_passages"])
        negs = ex["negative_passages"]
        if len(negs) >= self.n_neg:
            negs = rng.sample(negs, self.n_neg)
        else:
            negs = [rng.choice(negs) for _ in range(self.n_neg)]
        return ex["query"], [pos] + negs


class Collator:
    def __init__(self, tok, q_max_len, p_max_len):
        self.tok = tok
        self.q_max_len = q_max_len
        self.p_max_len = p_max_len

    def __call__(self, batch):
        queries = [q for q, _ in batch]
        passages = [fmt_passage(p) for _, group in batch for p in group]
        q = self.tok(queries, padding=True, truncation=True, max_length=self.q_max_len, return_tensors="pt")
        p = self.tok(passages, padding=True, truncation=True, max_length=self.p_max_len, return_tensors="pt")
        return q, p


class BiEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.q_encoder = AutoModel.from_pretrained(name)
        self.p_encoder = AutoModel.from_pretrained(name)

    @staticmethod
    def _cls(encoder, batch):
        out = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], return_dict=True)
        return out.last_hidden_state[:, 0]

    def encode_query(self, batch):
        return self._cls(self.q_encoder, batch)

    def encode_passage(self, batch):
        return self._cls(self.p_encoder, batch)

    def forward(self, q_batch, p_batch):
        return self.encode_query(q_batch), self.encode_passage(p_batch)


def gather_keep_grad(t):
    world = dist.get_world_size()
    if world == 1:
        return t
    bufs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(bufs, t.contiguous())
    bufs[dist.get_rank()] = t
    return torch.cat(bufs, dim=0)


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def load_tsv(path):
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(line.rstrip("\n").split("\t"))
    return rows


def load_qrels(path):
    qrels = defaultdict(set)
    with open(path) as f:
        for line in f:
            qid, _, pid, rel = line.split()
            if int(rel) > 0:
                qrels[qid].add(pid)
    return qrels


@torch.no_grad()
def encode_texts(encode_fn, tok, texts, max_len, bs, device, fp16):
    out = []
    for i in range(0, len(texts), bs):
        batch = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            emb = encode_fn(to_device(batch, device))
        out.append(emb.float().cpu().numpy())
    if not out:
        return np.zeros((0, 768), dtype=np.float32)
    return np.concatenate(out, 0)


def evaluate(model, tok, args, device, rank, world):
    raw = model.module
    raw.eval()
    corpus = load_tsv(args.dev_corpus)
    shard = corpus[rank::world]
    texts = [f"{r[1]} [SEP] {r[2]}" if r[1] else r[2] for r in shard]
    p_emb = encode_texts(raw.encode_passage, tok, texts, args.p_max_len, args.eval_batch_size, device, args.fp16)
    gathered = [None] * world
    dist.all_gather_object(gathered, ([r[0] for r in shard], p_emb))

    metrics = None
    if rank == 0:
        pids = [pid for ids, _ in gathered for pid in ids]
        emb = np.concatenate([e for _, e in gathered], 0).astype(np.float32)
        index = faiss.IndexFlatIP(emb.shape[1])
        index.add(emb)
        queries = load_tsv(args.dev_queries)
        qrels = load_qrels(args.dev_qrels)
        q_emb = encode_texts(raw.encode_query, tok, [q[1] for q in queries], args.q_max_len,
                             args.eval_batch_size, device, args.fp16)
        _, I = index.search(q_emb.astype(np.float32), 100)
        mrr, r100, n = 0.0, 0.0, 0
        for (qid, _), row in zip(queries, I):
            rel = qrels.get(qid)
            if not rel:
                continue
            n += 1
            ranked = [pids[j] for j in row]
            for k, pid in enumerate(ranked[:10]):
                if pid in rel:
                    mrr += 1.0 / (k + 1)
                    break
            r100 += len(rel & set(ranked)) / len(rel)
        metrics = {"mrr@10": mrr / max(n, 1), "recall@100": r100 / max(n, 1), "n": n}
    dist.barrier()
    raw.train()
    return metrics


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name)
    train_ds = TrainDataset(args.train_file, args.hard_negatives, args.seed)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=sampler, num_workers=4,
                        collate_fn=Collator(tok, args.q_max_len, args.p_max_len), pin_memory=True, drop_last=True)

    model = BiEncoder(args.model_name).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    logger.info("train queries=%d world=%d steps/epoch=%d", len(train_ds), world, len(loader))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    best_mrr, step = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_ds.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for q_batch, p_batch in loader:
            q_batch, p_batch = to_device(q_batch, device), to_device(p_batch, device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                q_reps, p_reps = model(q_batch, p_batch)
            q_all = gather_keep_grad(q_reps.float())
            p_all = gather_keep_grad(p_reps.float())
            scores = q_all @ p_all.t() / args.temperature
            group = p_reps.size(0) // q_reps.size(0)
            target = torch.arange(q_all.size(0), device=device) * group
            # every rank computes the full loss; DDP averages, so undo the 1/world
            loss = F.cross_entropy(scores, target) * world

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if step % args.log_every == 0:
                logger.info("epoch %d step %d loss %.4f lr %.2e %.1fs", epoch, step, loss.item() / world,
                            scheduler.get_last_lr()[0], time.time() - t0)

        metrics = evaluate(model, tok, args, device, rank, world)
        if rank == 0:
            logger.info("epoch %d dev %s", epoch, json.dumps(metrics))
            if metrics["mrr@10"] > best_mrr:
                best_mrr = metrics["mrr@10"]
                out = os.path.join(args.output_dir, "best")
                model.module.q_encoder.save_pretrained(os.path.join(out, "query_encoder"))
                model.module.p_encoder.save_pretrained(os.path.join(out, "passage_encoder"))
                tok.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
