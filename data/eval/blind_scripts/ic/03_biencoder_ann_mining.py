#!/usr/bin/env python
# Bi-encoder for product search (asymmetric: small query encoder, larger product encoder).
# Hard negatives are re-mined every epoch from an HNSW index over the current product
# embeddings.  Rank 0 owns the index; the mined lists are broadcast to the other ranks.
#
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
#       03_biencoder_ann_mining.py --train_dir /fsx/search/clicklogs/2024q2 --out /fsx/ckpt/bienc
import argparse
import datetime
import json
import os
import random
import time

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--query_model", default="intfloat/e5-small-v2")
    ap.add_argument("--product_model", default="intfloat/e5-base-v2")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--per_gpu_batch", type=int, default=64)
    ap.add_argument("--n_neg", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--tau", type=float, default=0.02)
    ap.add_argument("--mine_depth", type=int, default=200)
    ap.add_argument("--mine_skip", type=int, default=10)
    return ap.parse_args()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


class SearchData:
    """queries_{train,dev}.jsonl: {qid, text, positives: [pid,...]};  catalog.jsonl: {pid, title, attrs}"""

    def __init__(self, root):
        self.catalog = read_jsonl(os.path.join(root, "catalog.jsonl"))
        self.pids = [c["pid"] for c in self.catalog]
        self.pid_text = {c["pid"]: "passage: " + c["title"] + " " + " ".join(c.get("attrs", [])) for c in self.catalog}
        self.train = read_jsonl(os.path.join(root, "queries_train.jsonl"))
        self.dev = read_jsonl(os.path.join(root, "queries_dev.jsonl"))


class ContrastiveSet(Dataset):
    def __init__(self, data, negatives, n_neg):
        self.data, self.negatives, self.n_neg = data, negatives, n_neg

    def __len__(self):
        return len(self.data.train)

    def __getitem__(self, i):
        q = self.data.train[i]
        pos = random.choice(q["positives"])
        pool = self.negatives.get(q["qid"]) or self.data.pids
        negs = random.sample(pool, self.n_neg) if len(pool) >= self.n_neg else random.choices(pool, k=self.n_neg)
        return "query: " + q["text"], [self.data.pid_text[pos]] + [self.data.pid_text[n] for n in negs]


class BiEncoder(nn.Module):
    def __init__(self, q_name, p_name, out_dim=384):
        super().__init__()
        self.q_enc = AutoModel.from_pretrained(q_name, add_pooling_layer=False)
        self.p_enc = AutoModel.from_pretrained(p_name, add_pooling_layer=False)
        self.q_proj = nn.Linear(self.q_enc.config.hidden_size, out_dim)
        self.p_proj = nn.Linear(self.p_enc.config.hidden_size, out_dim)

    @staticmethod
    def _pool(enc, batch):
        h = enc(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1)

    def encode_queries(self, batch):
        return F.normalize(self.q_proj(self._pool(self.q_enc, batch)), dim=-1)

    def encode_products(self, batch):
        return F.normalize(self.p_proj(self._pool(self.p_enc, batch)), dim=-1)

    def forward(self, q_batch, p_batch):
        return self.encode_queries(q_batch), self.encode_products(p_batch)


class Trainer:
    def __init__(self, args):
        self.args = args
        dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)

        self.data = SearchData(args.train_dir)
        self.q_tok = AutoTokenizer.from_pretrained(args.query_model)
        self.p_tok = AutoTokenizer.from_pretrained(args.product_model)
        self.negatives = {}

        model = BiEncoder(args.query_model, args.product_model).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.train_set = ContrastiveSet(self.data, self.negatives, args.n_neg)
        self.sampler = DistributedSampler(self.train_set, shuffle=True, drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=args.per_gpu_batch, sampler=self.sampler,
                                 collate_fn=self.collate, num_workers=4, drop_last=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        steps = len(self.loader) * args.epochs
        self.sched = get_cosine_schedule_with_warmup(self.opt, int(0.06 * steps), steps)

    def log(self, msg):
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def collate(self, batch):
        queries, groups = zip(*batch)
        q = self.q_tok(list(queries), padding=True, truncation=True, max_length=32, return_tensors="pt")
        flat = [t for g in groups for t in g]
        p = self.p_tok(flat, padding=True, truncation=True, max_length=128, return_tensors="pt")
        return q, p

    @torch.no_grad()
    def _embed(self, texts, tok, fn, max_len, bs=512):
        out = []
        for i in range(0, len(texts), bs):
            b = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(self.device)
            with torch.autocast("cuda", dtype=torch.float16):
                out.append(fn(b).float().cpu())
        return torch.cat(out).numpy()

    def build_index(self):
        self.model.eval()
        p_emb = self._embed([self.data.pid_text[p] for p in self.data.pids], self.p_tok,
                            self.model.encode_products, 128)
        index = faiss.IndexHNSWFlat(p_emb.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 256
        index.add(p_emb)
        return index

    def mine(self):
        payload = [None]
        if self.rank == 0:
            t0 = time.time()
            index = self.build_index()
            q_emb = self._embed(["query: " + q["text"] for q in self.data.train], self.q_tok,
                                self.model.module.encode_queries, 32)
            _, idx = index.search(q_emb, self.args.mine_depth)
            mined = {}
            for q, row in zip(self.data.train, idx):
                pos = set(q["positives"])
                mined[q["qid"]] = [self.data.pids[j] for j in row[self.args.mine_skip:]
                                   if j >= 0 and self.data.pids[j] not in pos]
            payload = [mined]
            self.log(f"mined negatives for {len(mined)} queries in {time.time() - t0:.0f}s")
        dist.broadcast_object_list(payload, src=0)
        self.negatives.clear()
        self.negatives.update(payload[0])
        self.model.train()

    def evaluate(self):
        result = [None]
        if self.rank == 0:
            index = self.build_index()
            q_emb = self._embed(["query: " + q["text"] for q in self.data.dev], self.q_tok,
                                self.model.module.encode_queries, 32)
            _, idx = index.search(q_emb, 100)
            mrr, recall = 0.0, 0.0
            for q, row in zip(self.data.dev, idx):
                pos = set(q["positives"])
                ranked = [self.data.pids[j] for j in row if j >= 0]
                first = next((r for r, p in enumerate(ranked[:10]) if p in pos), None)
                mrr += 0.0 if first is None else 1.0 / (first + 1)
                recall += len(pos.intersection(ranked)) / len(pos)
            n = max(len(self.data.dev), 1)
            result = [(mrr / n, recall / n)]
        dist.broadcast_object_list(result, src=0)
        self.model.train()
        return result[0]

    def train(self):
        a = self.args
        best = 0.0
        for epoch in range(a.epochs):
            if epoch > 0:
                self.mine()
            self.sampler.set_epoch(epoch)
            self.model.train()
            for step, (q, p) in enumerate(self.loader):
                q = q.to(self.device)
                p = p.to(self.device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    q_emb, p_emb = self.model(q, p)
                scores = q_emb.float() @ p_emb.float().T / a.tau
                # positive of query i sits at column i * (1 + n_neg)
                target = torch.arange(q_emb.size(0), device=self.device) * (1 + a.n_neg)
                loss = F.cross_entropy(scores, target)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                self.sched.step()
                if step % 50 == 0:
                    self.log(f"ep {epoch} step {step}/{len(self.loader)} loss {loss.item():.4f}")
            mrr, recall = self.evaluate()
            self.log(f"ep {epoch} dev MRR@10={mrr:.4f} R@100={recall:.4f}")
            if self.rank == 0:
                os.makedirs(a.out, exist_ok=True)
                torch.save(self.model.module.state_dict(), os.path.join(a.out, "last.pt"))
                if mrr > best:
                    torch.save(self.model.module.state_dict(), os.path.join(a.out, "best.pt"))
            best = max(best, mrr)
            dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(get_args()).train()
