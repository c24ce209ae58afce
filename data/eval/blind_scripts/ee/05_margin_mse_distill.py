#!/usr/bin/env python3
"""Margin-MSE distillation of a cross-encoder teacher into a dot-product bi-encoder.

Input triples (tsv): teacher_pos_score  teacher_neg_score  qid  pos_pid  neg_pid
Tokenized triples are cached next to the training file so later runs skip tokenization.

    torchrun --nproc_per_node=8 05_margin_mse_distill.py \
        --triples /data/marco/bert_cat_ensemble_msmarcopassage_train_scores_ids.tsv \
        --queries /data/marco/queries.train.tsv --collection /data/marco/collection.tsv \
        --out /data/ckpt/distilbert-margin-mse
"""
import argparse
import logging
import os
import time
from collections import defaultdict

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer, get_constant_schedule_with_warmup

log = logging.getLogger("margin_mse")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="distilbert-base-uncased")
    ap.add_argument("--triples", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--collection", required=True)
    ap.add_argument("--dev_queries", default="/data/marco/queries.dev.small.tsv")
    ap.add_argument("--dev_qrels", default="/data/marco/qrels.dev.small.tsv")
    ap.add_argument("--dev_pids", default="/data/marco/dev.small.bm25top100.pids.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=7e-6)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--eval_every", type=int, default=20_000)
    ap.add_argument("--q_len", type=int, default=30)
    ap.add_argument("--p_len", type=int, default=200)
    ap.add_argument("--max_triples", type=int, default=None)
    return ap.parse_args()


def read_tsv_dict(path):
    d = {}
    with open(path, encoding="utf8") as f:
        for line in f:
            k, v = line.rstrip("\n").split("\t", 1)
            d[k] = v
    return d


def build_or_load_cache(args, tok):
    cache = f"{args.triples}.{os.path.basename(args.model)}.q{args.q_len}.p{args.p_len}.pt"
    if os.path.exists(cache):
        log.info("loading tokenized triples from %s", cache)
        return torch.load(cache)

    log.info("tokenizing %s (first run, this takes a while)", args.triples)
    queries = read_tsv_dict(args.queries)
    collection = read_tsv_dict(args.collection)
    q_ids, pos_ids, neg_ids, margins = [], [], [], []
    with open(args.triples) as f:
        for i, line in enumerate(tqdm(f, disable=int(os.environ.get("RANK", 0)) != 0)):
            if args.max_triples and i >= args.max_triples:
                break
            pos_score, neg_score, qid, pos, neg = _parse_triple(line)
            q_ids.append(tok.encode(queries[qid], add_special_tokens=True, truncation=True, max_length=args.q_len))
            pos_ids.append(tok.encode(collection[pos], truncation=True, max_length=args.p_len))
            neg_ids.append(tok.encode(collection[neg], truncation=True, max_length=args.p_len))
            margins.append(pos_score - neg_score)
    data = {"q": q_ids, "pos": pos_ids, "neg": neg_ids, "margin": margins}
    torch.save(data, cache)
    return data


def _parse_triple(line):
    pos_score, neg_score, qid, pos, neg = line.rstrip("\n").split("\t")
    return float(pos_score), float(neg_score), qid, pos, neg


class CachedTriples(Dataset):
    def __init__(self, data):
        self.d = data

    def __len__(self):
        return len(self.d["margin"])

    def __getitem__(self, i):
        return self.d["q"][i], self.d["pos"][i], self.d["neg"][i], self.d["margin"][i]


def pad(seqs, pad_id):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        q, pos, neg, m = zip(*batch)
        return pad(q, self.pad_id), pad(pos, self.pad_id), pad(neg, self.pad_id), torch.tensor(m)


class DotEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)

    def encode(self, x):
        return self.bert(**x).last_hidden_state[:, 0, :]

    def forward(self, q, pos, neg):
        qv, pv, nv = self.encode(q), self.encode(pos), self.encode(neg)
        return (qv * pv).sum(-1), (qv * nv).sum(-1)


@torch.no_grad()
def encode_all(enc, tok, texts, max_len, device, bs=512):
    out = []
    for i in range(0, len(texts), bs):
        x = tok(texts[i:i + bs], truncation=True, max_length=max_len, padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out.append(enc.encode(x).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, enc.bert.config.hidden_size)


def evaluate(enc, tok, args, device, collection):
    rank, world = dist.get_rank(), dist.get_world_size()
    enc.eval()
    pids = [l.strip() for l in open(args.dev_pids)]
    mine = pids[rank::world]
    emb = encode_all(enc, tok, [collection[p] for p in mine], args.p_len, device).numpy()
    parts = [None] * world
    dist.all_gather_object(parts, (mine, emb))
    out = None
    if rank == 0:
        all_pids = [p for ids, _ in parts for p in ids]
        index = faiss.IndexFlatIP(parts[0][1].shape[1])
        index.add(np.concatenate([e for _, e in parts]).astype("float32"))
        dq = read_tsv_dict(args.dev_queries)
        qrels = defaultdict(set)
        for l in open(args.dev_qrels):
            a = l.split()
            qrels[a[0]].add(a[2])
        qids = [q for q in dq if q in qrels]
        qe = encode_all(enc, tok, [dq[q] for q in qids], args.q_len, device).numpy()
        _, I = index.search(qe, 100)
        mrr = r20 = r100 = 0.0
        for qid, row in zip(qids, I):
            ranked = [all_pids[j] for j in row]
            for k, p in enumerate(ranked[:10]):
                if p in qrels[qid]:
                    mrr += 1 / (k + 1)
                    break
            r20 += len(qrels[qid] & set(ranked[:20])) / len(qrels[qid])
            r100 += len(qrels[qid] & set(ranked)) / len(qrels[qid])
        n = len(qids)
        out = {"MRR@10": mrr / n, "R@20": r20 / n, "R@100": r100 / n}
    enc.train()
    return out


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.model)
    data = build_or_load_cache(args, tok)
    ds = CachedTriples(data)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                    num_workers=4, pin_memory=True, drop_last=True)
    collection = read_tsv_dict(args.collection)

    model = DDP(DotEncoder(args.model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = get_constant_schedule_with_warmup(opt, args.warmup)
    scaler = torch.cuda.amp.GradScaler()
    mse = nn.MSELoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, epoch, best = 0, 0, 0.0
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for q, pos, neg, margin in dl:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            pos = {k: v.to(device, non_blocking=True) for k, v in pos.items()}
            neg = {k: v.to(device, non_blocking=True) for k, v in neg.items()}
            margin = margin.to(device).float()
            with torch.autocast("cuda", dtype=torch.float16):
                s_pos, s_neg = model(q, pos, neg)
            loss = mse((s_pos - s_neg).float(), margin)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1

            if step % 500 == 0:
                log.info("step %d loss %.4f (%.1f it/s)", step, loss.item(), 500 / (time.time() - t0))
                t0 = time.time()
            if step % args.eval_every == 0:
                metrics = evaluate(model.module, tok, args, device, collection)
                if rank == 0:
                    log.info("step %d %s", step, metrics)
                    torch.save(model.module.state_dict(), os.path.join(args.out, f"step{step}.pt"))
                    if metrics["MRR@10"] > best:
                        best = metrics["MRR@10"]
                        model.module.bert.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
