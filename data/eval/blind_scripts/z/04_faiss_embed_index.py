# -*- coding: utf-8 -*-
"""
多卡抽取文档向量（bge 系列模型），all_gather 汇总后由 rank 0 建 FAISS 索引，
并用带标注的 query 集合评测 Recall@K / MRR@10。

启动：
    torchrun --nproc_per_node=8 04_faiss_embed_index.py \
        --corpus data/corpus.jsonl --queries data/dev_queries.jsonl \
        --model BAAI/bge-base-zh-v1.5 --out index/
"""
import argparse
import json
import logging
import os
import time

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer

logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(message)s")
log = logging.getLogger("embed")

QUERY_INSTRUCTION = "为这个句子生成表示以用于检索相关文章："


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True, help="jsonl: {pid, title, text}")
    ap.add_argument("--queries", default="", help="jsonl: {query, pos_pids}")
    ap.add_argument("--model", default="BAAI/bge-base-zh-v1.5")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--topk", type=int, default=100)
    ap.add_argument("--out", default="index")
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


class CorpusDataset(Dataset):
    def __init__(self, path):
        self.pids, self.texts = [], []
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                self.pids.append(d["pid"])
                self.texts.append((d.get("title", "") + " " + d["text"]).strip())

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return i, self.texts[i]


class TokCollate:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, batch):
        idx, texts = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        return torch.tensor(idx, dtype=torch.long), enc


@torch.no_grad()
def encode(model, loader, device, fp16, show=False):
    all_idx, all_emb = [], []
    t0 = time.time()
    for step, (idx, enc) in enumerate(loader):
        enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            out = model(**enc)
        emb = out.last_hidden_state[:, 0]  # bge 使用 CLS 向量
        emb = F.normalize(emb.float(), dim=-1)
        all_idx.append(idx.to(device))
        all_emb.append(emb)
        if show and step % 50 == 0:
            log.info("编码进度 %d/%d, %.1fs", step, len(loader), time.time() - t0)
    return torch.cat(all_idx), torch.cat(all_emb)


def gather_tensor(t, world_size):
    buf = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(buf, t.contiguous())
    return torch.cat(buf, dim=0)


def evaluate_retrieval(index, q_emb, queries, pids, topk):
    scores, I = index.search(q_emb, topk)
    recall = {1: 0, 10: 0, 100: 0}
    mrr = 0.0
    for qi, q in enumerate(queries):
        pos = set(q["pos_pids"])
        ranked = [pids[j] for j in I[qi] if j >= 0]
        for k in recall:
            if pos & set(ranked[:k]):
                recall[k] += 1
        for r, p in enumerate(ranked[:10]):
            if p in pos:
                mrr += 1.0 / (r + 1)
                break
    n = len(queries)
    return {f"R@{k}": v / n for k, v in recall.items()} | {"MRR@10": mrr / n}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model).to(device).eval()

    corpus = CorpusDataset(args.corpus)
    if rank == 0:
        log.info("语料共 %d 条，world_size=%d", len(corpus), world_size)

    loader = DataLoader(corpus, batch_size=args.batch_size, shuffle=False,
                        collate_fn=TokCollate(tok, args.max_len), num_workers=4, pin_memory=True)

    local_idx, local_emb = encode(model, loader, device, args.fp16, show=(rank == 0))
    log.info("rank %d 本地编码完成: %s", rank, tuple(local_emb.shape))

    # 汇总所有卡的向量和对应的下标
    all_idx = gather_tensor(local_idx, world_size).cpu().numpy()
    all_emb = gather_tensor(local_emb, world_size).cpu().numpy().astype(np.float32)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        dim = all_emb.shape[1]
        index = faiss.IndexIDMap(faiss.IndexFlatIP(dim))
        index.add_with_ids(all_emb, all_idx.astype(np.int64))
        faiss.write_index(index, os.path.join(args.out, "corpus.index"))
        with open(os.path.join(args.out, "pids.json"), "w", encoding="utf-8") as f:
            json.dump(corpus.pids, f, ensure_ascii=False)
        log.info("索引写出完成，ntotal=%d", index.ntotal)

        if args.queries:
            with open(args.queries, encoding="utf-8") as f:
                queries = [json.loads(l) for l in f if l.strip()]
            q_texts = [QUERY_INSTRUCTION + q["query"] for q in queries]
            q_embs = []
            with torch.no_grad():
                for s in range(0, len(q_texts), args.batch_size):
                    enc = tok(q_texts[s: s + args.batch_size], padding=True, truncation=True,
                              max_length=64, return_tensors="pt").to(device)
                    with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                        h = model(**enc).last_hidden_state[:, 0]
                    q_embs.append(F.normalize(h.float(), dim=-1).cpu())
            q_emb = torch.cat(q_embs).numpy().astype(np.float32)
            metrics = evaluate_retrieval(index, q_emb, queries, corpus.pids, args.topk)
            log.info("检索评测: %s", json.dumps(metrics, ensure_ascii=False))
            with open(os.path.join(args.out, "retrieval_metrics.json"), "w") as f:
                json.dump(metrics, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
