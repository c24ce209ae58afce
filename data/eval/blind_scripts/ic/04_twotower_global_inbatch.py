"""Two-tower retriever with global in-batch negatives.

Query/product embeddings from every rank are all-gathered (with gradient) so each
query is scored against the products of the *global* batch, not only the local
one.  Hard negatives come from a flat index that is rebuilt at the start of each
epoch from the current product tower.

Example:
    torchrun --nproc_per_node=8 04_twotower_global_inbatch.py \
        --data /data/search/esci_us --global_batch 4096 --out runs/tt_global
"""
import argparse
import hashlib
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backbone", default="BAAI/bge-small-en-v1.5")
    ap.add_argument("--global_batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--warmup_steps", type=int, default=500)
    ap.add_argument("--temp", type=float, default=0.02)
    ap.add_argument("--hn_from", type=int, default=30)
    ap.add_argument("--hn_to", type=int, default=200)
    ap.add_argument("--dev_pct", type=int, default=3)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def is_dev_query(query_id, pct):
    # stable across ranks, runs and machines
    return int(hashlib.sha1(str(query_id).encode()).hexdigest()[:8], 16) % 100 < pct


class Towers(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.query = AutoModel.from_pretrained(backbone, add_pooling_layer=False)
        self.product = AutoModel.from_pretrained(backbone, add_pooling_layer=False)

    @staticmethod
    def cls(enc, ids, mask):
        return F.normalize(enc(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0], dim=-1)

    def forward(self, q_ids, q_mask, p_ids, p_mask):
        return self.cls(self.query, q_ids, q_mask), self.cls(self.product, p_ids, p_mask)


class Examples(Dataset):
    def __init__(self, rows, neg_pool, prod_text, all_pids):
        self.rows, self.neg_pool, self.prod_text, self.all_pids = rows, neg_pool, prod_text, all_pids

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        qid, qtext, pid = self.rows[i]
        pool = self.neg_pool.get(qid)
        neg = random.choice(pool) if pool else random.choice(self.all_pids)
        return qtext, self.prod_text[pid], self.prod_text[neg]


def make_collate(tok):
    def collate(batch):
        q, p, n = zip(*batch)
        qt = tok(list(q), padding="max_length", truncation=True, max_length=24, return_tensors="pt")
        pt = tok(list(p) + list(n), padding="max_length", truncation=True, max_length=80, return_tensors="pt")
        return qt["input_ids"], qt["attention_mask"], pt["input_ids"], pt["attention_mask"]
    return collate


@torch.no_grad()
def embed(enc, tok, texts, max_len, device, bs=1024):
    vecs = [torch.empty(0, enc.config.hidden_size, device=device)]
    for i in range(0, len(texts), bs):
        t = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            vecs.append(Towers.cls(enc, t["input_ids"], t["attention_mask"]).float())
    return torch.cat(vecs)


@torch.no_grad()
def embed_catalog_all_ranks(enc, tok, texts, device, rank, world):
    """Contiguous equal-size blocks (last one zero-padded) so all_gather sees identical shapes."""
    block = math.ceil(len(texts) / world)
    mine = embed(enc, tok, texts[rank * block:(rank + 1) * block], 80, device)
    padded = mine.new_zeros(block, mine.shape[1])
    padded[: mine.shape[0]] = mine
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat(out)[: len(texts)]


@torch.no_grad()
def mine_and_eval(raw, tok, pids, prod_texts, train_q, dev_q, dev_pos, train_pos, args, device, rank, world):
    raw.eval()
    cat = embed_catalog_all_ranks(raw.product, tok, prod_texts, device, rank, world).to(torch.bfloat16)

    # hard negatives for this rank's share of training queries, then exchanged
    my_train = train_q[rank::world]
    mined = {}
    for i in range(0, len(my_train), 2048):
        chunk = my_train[i:i + 2048]
        qv = embed(raw.query, tok, [t for _, t in chunk], 24, device).to(torch.bfloat16)
        top = (qv @ cat.T).topk(args.hn_to, dim=1).indices.cpu().tolist()
        for (qid, _), row in zip(chunk, top):
            mined[qid] = [pids[j] for j in row[args.hn_from:] if pids[j] not in train_pos[qid]]
    parts = [None] * world
    dist.all_gather_object(parts, mined)
    pool = {k: v for part in parts for k, v in part.items()}

    # dev MRR@10, each rank on a disjoint slice, summed across ranks
    my_dev = dev_q[rank::world]
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(0, len(my_dev), 2048):
        chunk = my_dev[i:i + 2048]
        qv = embed(raw.query, tok, [t for _, t in chunk], 24, device).to(torch.bfloat16)
        top = (qv @ cat.T).topk(10, dim=1).indices.cpu().tolist()
        for (qid, _), row in zip(chunk, top):
            ranks = [r for r, j in enumerate(row) if pids[j] in dev_pos[qid]]
            acc[0] += 1.0 / (ranks[0] + 1) if ranks else 0.0
            acc[1] += 1
    dist.all_reduce(acc)
    raw.train()
    return pool, (acc[0] / acc[1].clamp(min=1)).item()


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    random.seed(1234 + rank)  # only drives per-rank negative sampling

    assert args.global_batch % world == 0, "global batch must divide evenly over ranks"
    per_gpu = args.global_batch // world

    df = pd.read_parquet(os.path.join(args.data, "judgements.parquet"))  # query_id, query, product_id, label
    df = df[df.label.isin(["E", "S"])]
    products = pd.read_parquet(os.path.join(args.data, "products.parquet"))
    prod_text = {r.product_id: f"{r.product_title} {r.product_brand or ''}" for r in products.itertuples()}
    pids = list(prod_text)
    prod_texts = [prod_text[p] for p in pids]

    dev_mask = df.query_id.map(lambda q: is_dev_query(q, args.dev_pct))
    train_df, dev_df = df[~dev_mask], df[dev_mask]
    train_rows = list(zip(train_df.query_id, train_df["query"], train_df.product_id))
    train_pos = train_df.groupby("query_id").product_id.agg(set).to_dict()
    dev_pos = dev_df.groupby("query_id").product_id.agg(set).to_dict()
    train_q = sorted(set(zip(train_df.query_id, train_df["query"])))
    dev_q = sorted(set(zip(dev_df.query_id, dev_df["query"])))

    tok = AutoTokenizer.from_pretrained(args.backbone)
    raw = Towers(args.backbone).to(device)
    opt = torch.optim.AdamW(raw.parameters(), lr=args.lr, weight_decay=0.01)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        raw.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1
    model = DDP(raw, device_ids=[local_rank])

    neg_pool = {}
    ds = Examples(train_rows, neg_pool, prod_text, pids)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    # drop_last on both: the gathered batch must have the same size on every rank
    loader = DataLoader(ds, batch_size=per_gpu, sampler=sampler, num_workers=8,
                        collate_fn=make_collate(tok), drop_last=True, pin_memory=True)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) * max(0.0, 1 - s / total))
    for _ in range(start_epoch * len(loader)):
        sched.step()

    for epoch in range(start_epoch, args.epochs):
        pool, dev_mrr = mine_and_eval(raw, tok, pids, prod_texts, train_q, dev_q, dev_pos, train_pos,
                                      args, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} (before training) dev MRR@10 = {dev_mrr:.4f}", flush=True)
        neg_pool.clear()
        neg_pool.update(pool)
        sampler.set_epoch(epoch)
        model.train()
        for step, (qi, qm, pi, pm) in enumerate(loader):
            qi, qm, pi, pm = (t.to(device, non_blocking=True) for t in (qi, qm, pi, pm))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, p = model(qi, qm, pi, pm)
            q, p = q.float(), p.float()
            # p is [positives; hard negatives] for the local batch
            all_q = torch.cat(dist_fn.all_gather(q), 0)
            all_p = torch.cat(dist_fn.all_gather(p), 0)
            n_local = q.size(0)
            all_pos = all_p.view(world, 2, n_local, -1)[:, 0].reshape(world * n_local, -1)
            all_neg = all_p.view(world, 2, n_local, -1)[:, 1].reshape(world * n_local, -1)
            logits = all_q @ torch.cat([all_pos, all_neg]).T / args.temp
            target = torch.arange(all_q.size(0), device=device)
            loss = F.cross_entropy(logits, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.4f}", flush=True)

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": raw.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"ckpt_{epoch}.pt"))
        dist.barrier()

    _, dev_mrr = mine_and_eval(raw, tok, pids, prod_texts, train_q, dev_q, dev_pos, train_pos,
                               args, device, rank, world)
    if rank == 0:
        print(f"final dev MRR@10 = {dev_mrr:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
