#!/usr/bin/env python
"""Cross-encoder over query + full product description (up to 512 tokens).

Descriptions, bullet points and attribute tables are concatenated, so sequences
are long; activation checkpointing keeps the per-GPU group size at 8.  The
relevance head is a 2-layer MLP on the first token (the encoder's own pooler is
not used).  Graded labels from judged data (0-3), listwise softmax loss with
label-derived target distribution.

    torchrun --nproc_per_node=8 19_crossenc_longdesc_ckpt.py --data /mnt/judged/v5 --out /mnt/ckpt/ce_long
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="bert-base-multilingual-cased")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--list_size", type=int, default=8)
    ap.add_argument("--lists_per_gpu", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def product_doc(p):
    attrs = "; ".join(f"{k}: {v}" for k, v in p.get("attributes", {}).items())
    bullets = " ".join(p.get("bullets", []))
    return f"{p['title']} [SEP] {p.get('brand', '')} [SEP] {bullets} [SEP] {attrs} [SEP] {p.get('description', '')}"


class JudgedLists(Dataset):
    def __init__(self, path, products, list_size, train):
        self.lists = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)  # {"qid", "query", "judgements": [[pid, grade], ...]}
                items = [(products[pid], g) for pid, g in r["judgements"] if pid in products]
                if train and len({g for _, g in items}) < 2:
                    continue
                self.lists.append((r["qid"], r["query"], items))
        self.list_size, self.train = list_size, train

    def __len__(self):
        return len(self.lists)

    def __getitem__(self, i):
        qid, query, items = self.lists[i]
        if self.train:
            items = random.sample(items, self.list_size) if len(items) >= self.list_size \
                else random.choices(items, k=self.list_size)
        return query, [product_doc(p) for p, _ in items], [float(g) for _, g in items]


class CrossEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)
        h = self.bert.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1))

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return self.head(out.last_hidden_state[:, 0]).squeeze(-1)


def make_collate(tok, max_len):
    def collate(batch):
        qs, docs, grades = [], [], []
        for q, d, g in batch:
            qs += [q] * len(d)
            docs += d
            grades.append(torch.tensor(g))
        enc = tok(qs, docs, truncation="only_second", max_length=max_len, padding=True, return_tensors="pt")
        return dict(enc), torch.stack(grades) if len({len(g) for g in grades}) == 1 else grades
    return collate


@torch.no_grad()
def evaluate(raw, tok, dev, max_len, device, rank, world, k=10):
    raw.eval()
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    stats = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(rank, len(dev), world):
        query, docs, grades = dev[i]
        scores = []
        for j in range(0, len(docs), 32):
            enc = tok([query] * len(docs[j:j + 32]), docs[j:j + 32], truncation="only_second",
                      max_length=max_len, padding=True, return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                scores.append(raw(**enc).float().cpu())
        s = torch.cat(scores).numpy()
        g = np.asarray(grades)
        dcg = ((2 ** g[np.argsort(-s)][:k] - 1) * disc[: min(k, len(g))]).sum()
        ideal = np.sort(g)[::-1][:k]
        idcg = ((2 ** ideal - 1) * disc[: len(ideal)]).sum()
        if idcg > 0:
            stats[0] += dcg / idcg
            stats[1] += 1
    dist.all_reduce(stats)
    raw.train()
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "products.jsonl")) as f:
        products = {p["pid"]: p for p in map(json.loads, f)}
    train = JudgedLists(os.path.join(args.data, "train.jsonl"), products, args.list_size, train=True)
    dev = JudgedLists(os.path.join(args.data, "dev.jsonl"), products, args.list_size, train=False)
    tok = AutoTokenizer.from_pretrained(args.encoder)

    raw = CrossEncoder(args.encoder)
    raw.bert.gradient_checkpointing_enable()
    raw.to(device)
    # pooler weights never receive gradients with a first-token head
    model = DDP(raw, device_ids=[local_rank], find_unused_parameters=True)

    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_size=args.lists_per_gpu, sampler=sampler, num_workers=4,
                        collate_fn=make_collate(tok, args.max_len), pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, math.ceil(0.1 * total), total)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (enc, grades) in enumerate(loader):
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            grades = grades.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                scores = model(**enc).float().view(-1, args.list_size)
            target = F.softmax(grades * 2.0, dim=-1)
            loss = -(target * F.log_softmax(scores, dim=-1)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (step + 1):.2f}s/step", flush=True)

        ndcg = evaluate(raw, tok, dev, args.max_len, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev nDCG@10 {ndcg:.4f}", flush=True)
            if ndcg > best:
                best = ndcg
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": raw.state_dict(), "encoder": args.encoder, "ndcg": ndcg},
                           os.path.join(args.out, "best.pt"))
                tok.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
