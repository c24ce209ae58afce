"""Encode a large passage corpus with a bi-encoder and evaluate retrieval recall@k.

    torchrun --nproc_per_node=8 08_embed_corpus.py \
        --model BAAI/bge-base-en-v1.5 --corpus data/corpus.jsonl \
        --queries data/dev_queries.jsonl --qrels data/dev_qrels.tsv --out_dir emb/bge-base

Each rank writes its embeddings to emb_rank{r}.npy; rank 0 concatenates them,
builds a flat inner-product index and computes recall.
"""
import argparse
import csv
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModel, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="BAAI/bge-base-en-v1.5")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--qrels", required=True)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--num_workers", type=int, default=6)
    ap.add_argument("--query_instruction", default="Represent this sentence for searching relevant passages: ")
    ap.add_argument("--topk", type=int, nargs="+", default=[1, 10, 100])
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


class JsonlTexts(Dataset):
    def __init__(self, path, text_key="text", title_key="title"):
        self.ids, self.texts = [], []
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                title = rec.get(title_key) or ""
                self.ids.append(str(rec["_id"]))
                self.texts.append((title + " " + rec[text_key]).strip())

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return i, self.texts[i]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        idx = torch.tensor([b[0] for b in batch])
        enc = self.tok([b[1] for b in batch], padding=True, truncation=True,
                       max_length=self.max_len, return_tensors="pt")
        return idx, enc


@torch.no_grad()
def encode(model, loader, device, amp_dtype, log=False):
    embs, rows = [], []
    t0 = time.time()
    for step, (idx, enc) in enumerate(loader):
        enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
        with torch.autocast("cuda", dtype=amp_dtype):
            out = model(**enc).last_hidden_state[:, 0]  # CLS pooling
        embs.append(F.normalize(out.float(), dim=-1).cpu())
        rows.append(idx)
        if log and step % 100 == 0:
            print(f"  encoded {step}/{len(loader)} batches ({time.time() - t0:.0f}s)", flush=True)
    return torch.cat(rows).numpy(), torch.cat(embs).numpy()


def load_qrels(path):
    qrels = defaultdict(set)
    with open(path) as f:
        reader = csv.reader(f, delimiter="\t")
        next(reader)
        for qid, did, score in reader:
            if int(score) > 0:
                qrels[qid].add(did)
    return qrels


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    amp_dtype = torch.float16 if args.fp16 else torch.bfloat16
    os.makedirs(args.out_dir, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model).to(device).eval()

    corpus = JsonlTexts(args.corpus)
    loader = DataLoader(
        corpus,
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.num_workers,
        collate_fn=Collator(tokenizer, args.max_len),
        pin_memory=True,
    )
    if rank == 0:
        print(f"corpus: {len(corpus)} passages, {world} ranks", flush=True)

    rows, embs = encode(model, loader, device, amp_dtype, log=rank == 0)
    np.save(os.path.join(args.out_dir, f"emb_rank{rank}.npy"), embs)
    np.save(os.path.join(args.out_dir, f"rows_rank{rank}.npy"), rows)
    dist.barrier()

    if rank == 0:
        all_rows, all_embs = [], []
        for r in range(world):
            all_rows.append(np.load(os.path.join(args.out_dir, f"rows_rank{r}.npy")))
            all_embs.append(np.load(os.path.join(args.out_dir, f"emb_rank{r}.npy")))
        all_rows = np.concatenate(all_rows)
        all_embs = np.concatenate(all_embs)
        doc_ids = [corpus.ids[i] for i in all_rows]
        np.save(os.path.join(args.out_dir, "corpus_emb.npy"), all_embs)
        with open(os.path.join(args.out_dir, "corpus_ids.json"), "w") as f:
            json.dump(doc_ids, f)

        # queries are small: encode them on rank 0 only
        queries = JsonlTexts(args.queries)
        queries.texts = [args.query_instruction + t for t in queries.texts]
        q_loader = DataLoader(queries, batch_size=args.batch_size,
                              collate_fn=Collator(tokenizer, 64))
        _, q_embs = encode(model, q_loader, device, amp_dtype)

        qrels = load_qrels(args.qrels)
        index = torch.from_numpy(all_embs).to(device, dtype=torch.float16)
        kmax = max(args.topk)
        recall = {k: 0.0 for k in args.topk}
        n_eval = 0
        for s in range(0, len(q_embs), 1024):
            q = torch.from_numpy(q_embs[s:s + 1024]).to(device, dtype=torch.float16)
            top = (q @ index.T).topk(kmax, dim=1).indices.cpu().numpy()
            for j, hits in enumerate(top):
                qid = queries.ids[s + j]
                if qid not in qrels:
                    continue
                n_eval += 1
                retrieved = [doc_ids[h] for h in hits]
                for k in args.topk:
                    recall[k] += len(qrels[qid] & set(retrieved[:k])) / len(qrels[qid])
        metrics = {f"recall@{k}": v / max(n_eval, 1) for k, v in recall.items()}
        metrics["num_queries"] = n_eval
        metrics["num_passages"] = int(all_embs.shape[0])
        print(json.dumps(metrics, indent=2))
        with open(os.path.join(args.out_dir, "retrieval_metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
