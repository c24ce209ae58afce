"""Help-center retrieval: user question -> canonical answer article (bi-encoder).

The export is one CSV of (question, article_id) pairs plus an article table. We hold out
a random 5% of *questions* as dev. Hard negatives = articles in the same product area.

torchrun --nproc_per_node=8 11_support_faq_retrieval.py \
    --pairs exports/helpcenter_pairs_2024q2.csv --articles exports/articles_2024q2.parquet --out runs/faq_v7
"""
import argparse
import logging
import os
import random
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("faq")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--articles", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="BAAI/bge-small-en-v1.5")
    ap.add_argument("--dev_frac", type=float, default=0.05)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--hard_negs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--temp", type=float, default=0.02)
    ap.add_argument("--q_len", type=int, default=48)
    ap.add_argument("--a_len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def article_text(row):
    return f"{row['title']}. {row['summary']} {row['body'][:2000]}"


class QADataset(Dataset):
    def __init__(self, pairs, articles, area_of, by_area, hard_negs):
        self.pairs = pairs
        self.articles = articles
        self.area_of = area_of
        self.by_area = by_area
        self.hard_negs = hard_negs
        self.all_ids = list(articles)

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        q, aid = self.pairs[i]
        same_area = [a for a in self.by_area[self.area_of[aid]] if a != aid]
        pool = same_area if len(same_area) >= self.hard_negs else self.all_ids
        negs = random.sample(pool, self.hard_negs)
        while aid in negs:
            negs = random.sample(self.all_ids, self.hard_negs)
        return q, [self.articles[aid]] + [self.articles[n] for n in negs]


class BGE(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.model = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, ids, mask):
        return F.normalize(self.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0], dim=-1)

    def forward(self, qi, qm, ai, am):
        return self.encode(qi, qm), self.encode(ai, am)


def all_gather_with_grad(x):
    xs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    xs[dist.get_rank()] = x
    return torch.cat(xs)


@torch.no_grad()
def encode_texts(enc, tok, texts, max_len, device, prefix=""):
    outs = []
    for i in range(0, len(texts), 256):
        t = tok([prefix + x for x in texts[i:i + 256]], max_length=max_len, truncation=True, padding=True,
                return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            outs.append(enc.encode(t["input_ids"], t["attention_mask"]).float())
    return torch.cat(outs) if outs else torch.zeros(0, enc.model.config.hidden_size, device=device)


QUERY_PREFIX = "Represent this sentence for searching relevant passages: "


def evaluate(enc, tok, dev_pairs, articles, args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    enc.eval()
    art_ids = sorted(articles)
    art_emb = encode_texts(enc, tok, [articles[a] for a in art_ids], args.a_len, device)
    my = dev_pairs[rank::world]
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # hit@1, hit@5, rr@10, n
    if my:
        q_emb = encode_texts(enc, tok, [q for q, _ in my], args.q_len, device, prefix=QUERY_PREFIX)
        top = (q_emb @ art_emb.t()).topk(10, dim=1).indices.tolist()
        for (_, gold), row in zip(my, top):
            ranked = [art_ids[j] for j in row]
            stats[0] += float(ranked[0] == gold)
            stats[1] += float(gold in ranked[:5])
            stats[2] += next((1.0 / (k + 1) for k, a in enumerate(ranked) if a == gold), 0.0)
            stats[3] += 1
    dist.all_reduce(stats)
    enc.train()
    n = stats[3].clamp(min=1)
    return {"acc@1": (stats[0] / n).item(), "acc@5": (stats[1] / n).item(), "MRR@10": (stats[2] / n).item()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    # different dropout masks / negative draws on every rank
    set_seed(args.seed + rank)

    art_df = pd.read_parquet(args.articles)
    articles = {r["article_id"]: article_text(r) for r in art_df.to_dict("records")}
    area_of = dict(zip(art_df["article_id"], art_df["product_area"]))
    by_area = defaultdict(list)
    for a, area in area_of.items():
        by_area[area].append(a)

    pairs_df = pd.read_csv(args.pairs).dropna(subset=["question", "article_id"])
    pairs_df = pairs_df[pairs_df["article_id"].isin(articles)]
    pairs = list(zip(pairs_df["question"].str.strip(), pairs_df["article_id"]))
    questions = sorted({q for q, _ in pairs})
    random.shuffle(questions)
    n_dev = int(len(questions) * args.dev_frac)
    dev_q = set(questions[:n_dev])
    train_pairs = [(QUERY_PREFIX + q, a) for q, a in pairs if q not in dev_q]
    dev_pairs = [(q, a) for q, a in pairs if q in dev_q]
    logger.info("articles=%d train pairs=%d dev pairs=%d", len(articles), len(train_pairs), len(dev_pairs))

    tok = AutoTokenizer.from_pretrained(args.model)

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=args.q_len, truncation=True, padding=True, return_tensors="pt")
        a = tok([x for b in batch for x in b[1]], max_length=args.a_len, truncation=True, padding=True,
                return_tensors="pt")
        return q["input_ids"], q["attention_mask"], a["input_ids"], a["attention_mask"]

    ds = QADataset(train_pairs, articles, area_of, by_area, args.hard_negs)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)

    model = DDP(BGE(args.model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, len(dl) * args.epochs)
    group = 1 + args.hard_negs

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (qi, qm, ai, am) in enumerate(dl):
            qi, qm, ai, am = qi.to(device), qm.to(device), ai.to(device), am.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, a = model(qi, qm, ai, am)
            q, a = all_gather_with_grad(q.float()), all_gather_with_grad(a.float())
            loss = F.cross_entropy(q @ a.t() / args.temp, torch.arange(q.size(0), device=device) * group) * world
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item() / world)

        m = evaluate(model.module, tok, dev_pairs, articles, args, device)
        logger.info("epoch %d dev %s", epoch, m)
        if rank == 0 and m["MRR@10"] > best:
            best = m["MRR@10"]
            model.module.model.save_pretrained(os.path.join(args.out, "best"))
            tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
