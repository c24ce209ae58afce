#!/usr/bin/env python
"""Two-tower retriever, hard negatives refreshed from the live catalog every epoch.

Catalog encoding is split over all ranks (each rank encodes one slice of the
product table) and the slices are all-gathered, so every rank holds the full
embedding matrix and can search it with a plain matmul + topk on its own GPU.

    torchrun --nproc_per_node=8 11_hardneg_catalog_shards.py --cfg configs/tt_hardneg.yaml
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger("tt")


class TwoTower(nn.Module):
    def __init__(self, q_name, d_name, dim):
        super().__init__()
        self.q_bert = AutoModel.from_pretrained(q_name, add_pooling_layer=False)
        self.d_bert = AutoModel.from_pretrained(d_name, add_pooling_layer=False)
        self.q_head = nn.Linear(self.q_bert.config.hidden_size, dim, bias=False)
        self.d_head = nn.Linear(self.d_bert.config.hidden_size, dim, bias=False)

    def q(self, ids, mask):
        return F.normalize(self.q_head(self.q_bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]), dim=-1)

    def d(self, ids, mask):
        return F.normalize(self.d_head(self.d_bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]), dim=-1)

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        return self.q(q_ids, q_mask), self.d(d_ids, d_mask)


class TrainSet(Dataset):
    def __init__(self, examples, doc_text, negatives, num_neg, catalog_ids):
        self.examples, self.doc_text = examples, doc_text
        self.negatives, self.num_neg, self.catalog_ids = negatives, num_neg, catalog_ids

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        qid, query, pid = self.examples[i]
        pool = self.negatives.get(qid) or self.catalog_ids
        negs = random.sample(pool, min(self.num_neg, len(pool)))
        while len(negs) < self.num_neg:
            negs.append(random.choice(self.catalog_ids))
        return query, [self.doc_text[pid]] + [self.doc_text[n] for n in negs]


def tokenize(tok, texts, max_len, device):
    t = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return t["input_ids"].to(device, non_blocking=True), t["attention_mask"].to(device, non_blocking=True)


@torch.no_grad()
def encode(fn, tok, texts, max_len, device, bs=512):
    embs = []
    for i in range(0, len(texts), bs):
        with torch.autocast("cuda", dtype=torch.float16):
            embs.append(fn(*tokenize(tok, texts[i:i + bs], max_len, device)).half())
    return torch.cat(embs)


@torch.no_grad()
def encode_catalog(raw, tok, doc_texts, cfg, device, rank, world):
    chunk = len(doc_texts) // world
    start = rank * chunk
    end = len(doc_texts) if rank == world - 1 else start + chunk
    local = encode(raw.d, tok, doc_texts[start:end], cfg["max_doc_len"], device)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    return torch.cat(parts)


@torch.no_grad()
def search(raw, tok, queries, doc_emb, k, cfg, device):
    q_emb = encode(raw.q, tok, queries, cfg["max_query_len"], device)
    return torch.cat([(q_emb[i:i + 1024] @ doc_emb.T).topk(k, dim=1).indices for i in range(0, len(q_emb), 1024)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(cfg["seed"])

    catalog = pd.read_parquet(cfg["catalog"])
    catalog_ids = catalog.product_id.tolist()
    doc_text = dict(zip(catalog.product_id, catalog.title + " " + catalog.category_path.fillna("")))
    doc_texts = [doc_text[p] for p in catalog_ids]
    labels = pd.read_parquet(cfg["labels"])  # query_id, query, product_id, split (query-level)
    train = labels[labels.split == "train"]
    dev = labels[labels.split == "dev"]
    examples = list(zip(train.query_id, train["query"], train.product_id))
    train_pos = train.groupby("query_id").product_id.agg(set).to_dict()
    train_queries = train.drop_duplicates("query_id")[["query_id", "query"]].sort_values("query_id")
    dev_pos = dev.groupby("query_id").product_id.agg(set).to_dict()
    dev_queries = dev.drop_duplicates("query_id")[["query_id", "query"]].sort_values("query_id")

    q_tok = AutoTokenizer.from_pretrained(cfg["query_model"])
    d_tok = AutoTokenizer.from_pretrained(cfg["doc_model"])
    raw = TwoTower(cfg["query_model"], cfg["doc_model"], cfg["dim"]).to(device)
    model = DDP(raw, device_ids=[local_rank])

    negatives = {}
    ds = TrainSet(examples, doc_text, negatives, cfg["num_neg"], catalog_ids)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)

    def collate(batch):
        qs, docs = zip(*batch)
        qi, qm = tokenize(q_tok, list(qs), cfg["max_query_len"], "cpu")
        di, dm = tokenize(d_tok, [d for grp in docs for d in grp], cfg["max_doc_len"], "cpu")
        return qi, qm, di, dm

    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    group = 1 + cfg["num_neg"]

    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        raw.eval()
        doc_emb = encode_catalog(raw, d_tok, doc_texts, cfg, device, rank, world)

        # dev recall with the index we are about to mine from
        hits = torch.zeros(2, device=device)
        dev_slice = dev_queries.iloc[rank::world]
        if len(dev_slice):
            top = search(raw, q_tok, dev_slice["query"].tolist(), doc_emb, 100, cfg, device).cpu().tolist()
            for qid, row in zip(dev_slice.query_id, top):
                hits[0] += len(dev_pos[qid].intersection(catalog_ids[j] for j in row)) / len(dev_pos[qid])
                hits[1] += 1
        dist.all_reduce(hits)
        log.info("epoch %d dev recall@100 %.4f", epoch, (hits[0] / hits[1].clamp(min=1)).item())

        if epoch > 0:
            tq = train_queries.iloc[rank::world]
            top = search(raw, q_tok, tq["query"].tolist(), doc_emb, cfg["mine_depth"], cfg, device).cpu().tolist()
            mine = {qid: [catalog_ids[j] for j in row[cfg["mine_skip"]:] if catalog_ids[j] not in train_pos[qid]]
                    for qid, row in zip(tq.query_id, top)}
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            negatives.clear()
            for g in gathered:
                negatives.update(g)
        del doc_emb
        log.info("index rebuilt / negatives refreshed in %.0fs", time.time() - t0)

        model.train()
        sampler.set_epoch(epoch)
        for step, (qi, qm, di, dm) in enumerate(loader):
            qi, qm, di, dm = (t.to(device, non_blocking=True) for t in (qi, qm, di, dm))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, d = model(qi, qm, di, dm)
            scores = (q.float() @ d.float().T) / cfg["temperature"]
            target = torch.arange(q.size(0), device=device) * group
            loss = F.cross_entropy(scores, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 100 == 0:
                log.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        if rank == 0:
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save(raw.state_dict(), os.path.join(cfg["out_dir"], f"tt_epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
