"""Domain adaptation of a dense retriever on synthetic queries (doc2query-generated) for
the internal wiki. Negatives: BM25 top-30 minus the source doc, plus every passage that
any GPU holds in the step (cross-device negatives).

  torchrun --nproc_per_node=8 14_synthetic_query_adapt.py --config configs/wiki_adapt.yaml
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
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("wiki_adapt")


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="key=value")
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    for kv in a.overrides:
        k, v = kv.split("=", 1)
        cfg[k] = yaml.safe_load(v)
    return argparse.Namespace(**cfg)


class SyntheticQueries(Dataset):
    """rows: {"query": str, "doc_id": str, "bm25_negs": [doc_id, ...]}"""

    def __init__(self, path, docs, n_neg):
        self.rows = [json.loads(l) for l in open(path)]
        self.docs, self.n_neg = docs, n_neg

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        negs = [d for d in r["bm25_negs"] if d != r["doc_id"]]
        negs = random.sample(negs, self.n_neg) if len(negs) >= self.n_neg else random.choices(negs, k=self.n_neg)
        return r["query"], [self.docs[r["doc_id"]]] + [self.docs[d] for d in negs]


class DualEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def embed(self, batch):
        h = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return h[:, 0]

    def forward(self, q, d):
        return self.embed(q), self.embed(d)


def gather_cross_device(x):
    bufs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, x.contiguous())
    bufs[dist.get_rank()] = x
    return torch.cat(bufs)


@torch.no_grad()
def embed_all(model, tok, texts, max_len, device, bs=256):
    vecs = []
    for i in range(0, len(texts), bs):
        b = tok(texts[i:i + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            vecs.append(model.embed(b).float().cpu())
    return torch.cat(vecs).numpy() if vecs else np.zeros((0, model.backbone.config.hidden_size), "float32")


def evaluate(model, tok, cfg, docs, device):
    """Human-labelled dev queries against the full wiki (~400k passages), sharded encoding."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    ids = sorted(docs)
    mine = ids[rank::world]
    vecs = embed_all(model, tok, [docs[d] for d in mine], cfg.doc_len, device)
    shards = [None] * world
    dist.all_gather_object(shards, (mine, vecs))
    result = None
    if rank == 0:
        order = [d for s in shards for d in s[0]]
        index = faiss.IndexFlatIP(shards[0][1].shape[1])
        index.add(np.concatenate([s[1] for s in shards]).astype("float32"))
        dev = [json.loads(l) for l in open(cfg.dev_file)]
        q = embed_all(model, tok, [r["query"] for r in dev], cfg.query_len, device)
        _, I = index.search(q, 100)
        mrr = r10 = r100 = 0.0
        for r, row in zip(dev, I):
            gold = set(r["relevant"])
            ranked = [order[j] for j in row]
            mrr += next((1 / (k + 1) for k, d in enumerate(ranked[:10]) if d in gold), 0.0)
            r10 += len(gold & set(ranked[:10])) / len(gold)
            r100 += len(gold & set(ranked)) / len(gold)
        result = {"MRR@10": mrr / len(dev), "R@10": r10 / len(dev), "R@100": r100 / len(dev)}
    model.train()
    return result


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    docs = {}
    with open(cfg.passages) as f:
        for line in f:
            d = json.loads(line)
            docs[d["id"]] = f"{d['page_title']} - {d['section']}: {d['text']}"

    tok = AutoTokenizer.from_pretrained(cfg.base_model)
    ds = SyntheticQueries(cfg.train_file, docs, cfg.num_negatives)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=cfg.query_len, truncation=True, padding=True, return_tensors="pt")
        d = tok([x for b in batch for x in b[1]], max_length=cfg.doc_len, truncation=True, padding=True,
                return_tensors="pt")
        return q, d

    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, num_workers=6,
                    drop_last=True, pin_memory=True)

    model = DDP(DualEncoder(cfg.base_model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total = len(dl) * cfg.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler()
    group = 1 + cfg.num_negatives

    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        logger.info("queries=%d docs=%d world=%d steps=%d", len(ds), len(docs), world, total)

    step, skipped = 0, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for q, d in dl:
            q, d = q.to(device), d.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                q_emb, d_emb = model(q, d)
            # local queries against the documents of every rank
            d_all = gather_cross_device(d_emb.float())
            scores = q_emb.float() @ d_all.t() / cfg.temperature
            offset = rank * d_emb.size(0)
            labels = offset + torch.arange(q_emb.size(0), device=device) * group
            loss = F.cross_entropy(scores, labels)

            if not torch.isfinite(loss):
                skipped += 1
                logger.warning("non-finite loss at step %d (skipped %d so far)", step, skipped)
                opt.zero_grad(set_to_none=True)
                continue

            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f %.1fs", epoch, step, loss.item(), time.time() - t0)

        metrics = evaluate(model.module, tok, cfg, docs, device)
        if rank == 0:
            logger.info("epoch %d dev %s", epoch, metrics)
            out = os.path.join(cfg.output_dir, f"epoch{epoch}")
            model.module.backbone.save_pretrained(out)
            tok.save_pretrained(out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
