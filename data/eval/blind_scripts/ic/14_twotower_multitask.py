#!/usr/bin/env python
"""Two-tower retriever with an auxiliary query-category classification task.

Main task: contrastive query -> product retrieval from purchase/click logs.
Auxiliary task: predict the leaf category of the purchased product from the
query embedding, which regularises the query tower for head/torso queries.
The aux head sees a 5k-way softmax, so it is only computed every
`aux_every` steps to keep the step time down.

  torchrun --nproc_per_node=8 14_twotower_multitask.py --data_dir /data/search/purchases_2024 \
      --out_dir /data/ckpt/tt_mt --aux_every 4
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--encoder", default="thenlper/gte-small")
    ap.add_argument("--batch_size", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--temp", type=float, default=0.05)
    ap.add_argument("--aux_weight", type=float, default=0.2)
    ap.add_argument("--aux_every", type=int, default=4)
    ap.add_argument("--eval_pool", type=int, default=2000)
    return ap.parse_args()


class MultiTaskTwoTower(nn.Module):
    def __init__(self, encoder, n_categories):
        super().__init__()
        self.q_enc = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        self.p_enc = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        h = self.q_enc.config.hidden_size
        self.cat_head = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Dropout(0.1), nn.Linear(h, n_categories))

    @staticmethod
    def pool(enc, ids, mask):
        out = enc(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(out.dtype)
        return (out * m).sum(1) / m.sum(1).clamp(min=1)

    def forward(self, q_ids, q_mask, p_ids, p_mask, with_aux=False):
        q = self.pool(self.q_enc, q_ids, q_mask)
        p = self.pool(self.p_enc, p_ids, p_mask)
        cat_logits = self.cat_head(q) if with_aux else None
        return F.normalize(q, dim=-1), F.normalize(p, dim=-1), cat_logits


class Purchases(Dataset):
    def __init__(self, df, prod_text):
        self.q = df["query"].tolist()
        self.pid = df["product_id"].tolist()
        self.cat = df["cat_idx"].tolist()
        self.prod_text = prod_text

    def __len__(self):
        return len(self.q)

    def __getitem__(self, i):
        return self.q[i], self.prod_text[self.pid[i]], self.cat[i]


def load(data_dir):
    prods = pd.read_parquet(os.path.join(data_dir, "products.parquet"), columns=["product_id", "title", "leaf_category"])
    cats = sorted(prods.leaf_category.unique())
    cat_idx = {c: i for i, c in enumerate(cats)}
    prod_text = dict(zip(prods.product_id, prods.title))
    prod_cat = dict(zip(prods.product_id, prods.leaf_category.map(cat_idx)))
    frames = {}
    for split in ("train", "dev"):
        df = pd.read_parquet(os.path.join(data_dir, f"{split}.parquet"), columns=["query_id", "query", "product_id"])
        df = df[df.product_id.isin(prod_text.keys())].copy()
        df["cat_idx"] = df.product_id.map(prod_cat)
        frames[split] = df
    return frames, prod_text, len(cats)


@torch.no_grad()
def evaluate(raw, tok, dev_df, prod_text, args, device, rank, world):
    """MRR / category accuracy with `eval_pool` products scored per chunk of dev purchases."""
    raw.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)  # rr sum, cat correct, n
    rows = list(zip(dev_df["query"], dev_df.product_id, dev_df.cat_idx))
    chunks = [rows[i:i + args.eval_pool] for i in range(0, len(rows), args.eval_pool)]
    for chunk in chunks[rank::world]:
        qs, pids, cats = zip(*chunk)
        qt = tok(list(qs), padding=True, truncation=True, max_length=32, return_tensors="pt").to(device)
        pt = tok([prod_text[p] for p in pids], padding=True, truncation=True, max_length=64, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q, p, logits = raw(qt["input_ids"], qt["attention_mask"], pt["input_ids"], pt["attention_mask"], with_aux=True)
        s = q.float() @ p.float().T
        rank_of_pos = (s > s.diagonal().unsqueeze(1)).sum(1) + 1
        acc[0] += (1.0 / rank_of_pos.double()).sum()
        acc[1] += (logits.argmax(-1) == torch.tensor(cats, device=device)).sum()
        acc[2] += len(chunk)
    dist.all_reduce(acc)
    raw.train()
    n = acc[2].clamp(min=1)
    return (acc[0] / n).item(), (acc[1] / n).item()


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if rank != 0:
        logger.setLevel(logging.WARNING)
    torch.manual_seed(3)

    frames, prod_text, n_cat = load(args.data_dir)
    tok = AutoTokenizer.from_pretrained(args.encoder)
    logger.info("train %d dev %d categories %d", len(frames["train"]), len(frames["dev"]), n_cat)

    def collate(batch):
        qs, ps, cats = zip(*batch)
        q = tok(list(qs), padding=True, truncation=True, max_length=32, return_tensors="pt")
        p = tok(list(ps), padding=True, truncation=True, max_length=64, return_tensors="pt")
        return q["input_ids"], q["attention_mask"], p["input_ids"], p["attention_mask"], torch.tensor(cats)

    train_ds = Purchases(frames["train"], prod_text)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True)

    raw = MultiTaskTwoTower(args.encoder, n_cat).to(device)
    model = DDP(raw, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": list(raw.q_enc.parameters()) + list(raw.p_enc.parameters()), "lr": args.lr},
        {"params": raw.cat_head.parameters(), "lr": args.lr * 10},
    ], weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * total), total)

    step, best = 0, -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for q_ids, q_mask, p_ids, p_mask, cats in loader:
            q_ids, q_mask, p_ids, p_mask, cats = (x.to(device, non_blocking=True)
                                                  for x in (q_ids, q_mask, p_ids, p_mask, cats))
            with_aux = step % args.aux_every == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, p, cat_logits = model(q_ids, q_mask, p_ids, p_mask, with_aux=with_aux)
            logits = q.float() @ p.float().T / args.temp
            target = torch.arange(q.size(0), device=device)
            loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
            if with_aux:
                loss = loss + args.aux_weight * F.cross_entropy(cat_logits.float(), cats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 200 == 0:
                logger.info("epoch %d step %d loss %.4f %.1f it/s", epoch, step, loss.item(),
                            200 / (time.time() - t0))
                t0 = time.time()

        mrr, cat_acc = evaluate(raw, tok, frames["dev"], prod_text, args, device, rank, world)
        logger.info("epoch %d dev MRR %.4f category acc %.4f", epoch, mrr, cat_acc)
        if rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            torch.save({"model": raw.state_dict(), "epoch": epoch, "mrr": mrr},
                       os.path.join(args.out_dir, "last.pt"))
            if mrr > best:
                torch.save({"model": raw.state_dict(), "epoch": epoch, "mrr": mrr},
                           os.path.join(args.out_dir, "best.pt"))
        best = max(best, mrr)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
