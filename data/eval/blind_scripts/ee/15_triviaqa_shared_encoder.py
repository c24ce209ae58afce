"""Shared-encoder DPR for TriviaQA (question / wiki-100w passage), hard negatives from
BM25 that do not contain the answer. Dev: top-k accuracy (answer string in a retrieved
passage) over the dev retrieval pool.

torchrun --nproc_per_node=8 15_triviaqa_shared_encoder.py \
    --train_json data/trivia-train.json --dev_json data/trivia-dev.json \
    --dev_pool data/trivia-dev-pool.tsv --save_dir checkpoints/tqa_shared
"""
import argparse
import functools
import json
import logging
import os
import random
import re
import string
import time
import unicodedata

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("tqa")


def normalize_answer(s):
    s = unicodedata.normalize("NFD", s).lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def has_answer(answers, text):
    text = normalize_answer(text)
    return any(normalize_answer(a) in text for a in answers if normalize_answer(a))


class TQATrain(Dataset):
    def __init__(self, path):
        data = json.load(open(path))
        self.items = [d for d in data if d["positive_ctxs"] and d["hard_negative_ctxs"]]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        d = self.items[i]
        pos = d["positive_ctxs"][0] if random.random() < 0.5 else random.choice(d["positive_ctxs"])
        neg = random.choice(d["hard_negative_ctxs"])
        return d["question"], (pos["title"], pos["text"]), (neg["title"], neg["text"])


class SharedEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, ids, mask, type_ids):
        return self.bert(input_ids=ids, attention_mask=mask, token_type_ids=type_ids).last_hidden_state[:, 0]

    def forward(self, q, c):
        return self.encode(*q), self.encode(*c)


def tokenize_batch(tok, batch, q_len, c_len):
    qs = tok([b[0] for b in batch], max_length=q_len, truncation=True, padding=True, return_tensors="pt")
    titles = [x[0] for b in batch for x in (b[1], b[2])]
    texts = [x[1] for b in batch for x in (b[1], b[2])]
    cs = tok(titles, texts, max_length=c_len, truncation="only_second", padding=True, return_tensors="pt")
    return ((qs["input_ids"], qs["attention_mask"], qs["token_type_ids"]),
            (cs["input_ids"], cs["attention_mask"], cs["token_type_ids"]))


def gather_with_local_grad(x):
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x
    return torch.cat(out)


@torch.no_grad()
def encode_passages(enc, tok, rows, c_len, device, bs=512):
    out = []
    for i in range(0, len(rows), bs):
        chunk = rows[i:i + bs]
        t = tok([r[1] for r in chunk], [r[2] for r in chunk], max_length=c_len, truncation="only_second",
                padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out.append(enc.encode(t["input_ids"], t["attention_mask"], t["token_type_ids"]).float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, 768), "float32")


def dev_topk_accuracy(enc, tok, args, device, ks=(5, 20, 100)):
    rank, world = dist.get_rank(), dist.get_world_size()
    enc.eval()
    pool = [l.rstrip("\n").split("\t") for l in open(args.dev_pool)][1:]  # id, text, title
    pool = [(r[0], r[2], r[1]) for r in pool]
    mine = pool[rank::world]
    vecs = encode_passages(enc, tok, mine, args.c_len, device)
    parts = [None] * world
    dist.all_gather_object(parts, (list(range(rank, len(pool), world)), vecs))
    acc = None
    if rank == 0:
        order = [i for p in parts for i in p[0]]
        index = faiss.IndexFlatIP(768)
        index.add(np.concatenate([p[1] for p in parts]).astype("float32"))
        dev = json.load(open(args.dev_json))
        hits = {k: 0 for k in ks}
        for s in range(0, len(dev), 512):
            qs = dev[s:s + 512]
            t = tok([d["question"] for d in qs], max_length=args.q_len, truncation=True, padding=True,
                    return_tensors="pt").to(device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                qv = enc.encode(t["input_ids"], t["attention_mask"], t["token_type_ids"]).float().cpu().numpy()
            _, I = index.search(qv, max(ks))
            for d, row in zip(qs, I):
                found = [has_answer(d["answers"], pool[order[j]][2]) for j in row]
                for k in ks:
                    hits[k] += int(any(found[:k]))
        acc = {f"top{k}": hits[k] / len(dev) for k in ks}
    enc.train()
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_json", required=True)
    ap.add_argument("--dev_json", required=True)
    ap.add_argument("--dev_pool", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    ap.add_argument("--q_len", type=int, default=64)
    ap.add_argument("--c_len", type=int, default=256)
    ap.add_argument("--eval_every", type=int, default=2, help="epochs")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    train = TQATrain(args.train_json)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True,
                        collate_fn=functools.partial(tokenize_batch, tok, q_len=args.q_len, c_len=args.c_len))

    model = DDP(SharedEncoder(args.model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        logger.info("train questions=%d steps/epoch=%d world=%d", len(train), len(loader), world)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for it, (q, c) in enumerate(loader):
            q = tuple(x.to(device, non_blocking=True) for x in q)
            c = tuple(x.to(device, non_blocking=True) for x in c)
            with torch.autocast("cuda", dtype=torch.float16):
                qv, cv = model(q, c)
            qv, cv = gather_with_local_grad(qv.float()), gather_with_local_grad(cv.float())
            scores = qv @ cv.t()
            target = torch.arange(0, cv.size(0), 2, device=device)
            loss = F.cross_entropy(scores, target) * world
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % 200 == 0:
                logger.info("epoch %d it %d loss %.4f (%.0fs)", epoch, it, loss.item() / world, time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            acc = dev_topk_accuracy(model.module, tok, args, device)
            if rank == 0:
                logger.info("epoch %d dev %s", epoch, acc)
                if acc["top20"] > best:
                    best = acc["top20"]
                    model.module.bert.save_pretrained(os.path.join(args.save_dir, "best"))
                    tok.save_pretrained(os.path.join(args.save_dir, "best"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
