"""ANCE-FirstP style dense retriever (RoBERTa + projection head) trained with
negatives from a previous checkpoint's ANN index, cross-batch negatives over all GPUs.

  torchrun --nproc_per_node=8 09_ance_firstp_roberta.py \
      --train_file ann_data/ann_training_data_0.tsv --data_dir preprocessed/marco \
      --output_dir ckpt/ance_firstp
"""
import argparse
import csv
import logging
import os
import pickle
import random
import time

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, RobertaModel, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", type=str, required=True, help="qid \\t pos_pid \\t neg_pid,neg_pid,...")
    parser.add_argument("--data_dir", type=str, required=True)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--model_name_or_path", type=str, default="roberta-base")
    parser.add_argument("--max_query_length", type=int, default=64)
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--per_gpu_train_batch_size", type=int, default=16)
    parser.add_argument("--negatives_per_query", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=1e-6)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--warmup_steps", type=int, default=5000)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--logging_steps", type=int, default=100)
    parser.add_argument("--save_steps", type=int, default=10000)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0, help="local rank for distributed training")
    return parser.parse_args()


class EmbeddingHead(nn.Module):
    def __init__(self, hidden, dim=768):
        super().__init__()
        self.proj = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.proj(x))


class RobertaDot(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.roberta = RobertaModel.from_pretrained(name, add_pooling_layer=False)
        self.head = EmbeddingHead(self.roberta.config.hidden_size)

    def embed(self, ids, mask):
        cls = self.roberta(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return self.head(cls)

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        return self.embed(q_ids, q_mask), self.embed(d_ids, d_mask)


class AnnTriples(Dataset):
    def __init__(self, path, queries, passages, n_neg):
        self.rows = []
        with open(path) as f:
            for qid, pos, negs in csv.reader(f, delimiter="\t"):
                self.rows.append((qid, pos, negs.split(",")))
        self.queries, self.passages, self.n_neg = queries, passages, n_neg

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        qid, pos, negs = self.rows[i]
        negs = random.sample(negs, self.n_neg)
        return self.queries[qid], [self.passages[pos]] + [self.passages[n] for n in negs]


def load_pickled(data_dir, name):
    with open(os.path.join(data_dir, name), "rb") as f:
        return pickle.load(f)


def all_gather_keep_local(x):
    bufs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, x)
    bufs[dist.get_rank()] = x
    return torch.cat(bufs, 0)


@torch.no_grad()
def encode(model, tok, texts, max_len, device, fp16, bs=128):
    vecs = []
    for i in range(0, len(texts), bs):
        t = tok(texts[i:i + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt")
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            vecs.append(model.embed(t["input_ids"].to(device), t["attention_mask"].to(device)).float().cpu())
    return torch.cat(vecs).numpy() if vecs else np.zeros((0, 768), "float32")


def dev_eval(model, tok, args, dev, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    pids = dev["pids"]
    local = pids[rank::world]
    emb = encode(model, tok, [dev["passages"][p] for p in local], args.max_seq_length, device, args.fp16)
    shards = [None] * world
    dist.all_gather_object(shards, (local, emb))
    out = None
    if rank == 0:
        order = [p for s in shards for p in s[0]]
        index = faiss.IndexFlatIP(768)
        index.add(np.concatenate([s[1] for s in shards]).astype("float32"))
        qids = list(dev["queries"])
        q_emb = encode(model, tok, [dev["queries"][q] for q in qids], args.max_query_length, device, args.fp16)
        _, I = index.search(q_emb, 100)
        mrr = recall = 0.0
        for qid, row in zip(qids, I):
            rel = dev["qrels"].get(qid, set())
            ranked = [order[j] for j in row]
            mrr += next((1.0 / (k + 1) for k, p in enumerate(ranked[:10]) if p in rel), 0.0)
            recall += len(rel & set(ranked)) / max(1, len(rel))
        out = (mrr / len(qids), recall / len(qids))
    model.train()
    return out


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARN)
    random.seed(args.seed + rank)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name_or_path)
    queries = load_pickled(args.data_dir, "train_queries.pkl")
    passages = load_pickled(args.data_dir, "passages.pkl")
    dev = load_pickled(args.data_dir, "dev_subset.pkl")  # {"queries", "qrels", "pids", "passages"}

    train_ds = AnnTriples(args.train_file, queries, passages, args.negatives_per_query)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=args.max_query_length, truncation=True, padding=True,
                return_tensors="pt")
        d = tok([p for b in batch for p in b[1]], max_length=args.max_seq_length, truncation=True, padding=True,
                return_tensors="pt")
        return q["input_ids"], q["attention_mask"], d["input_ids"], d["attention_mask"]

    loader = DataLoader(train_ds, sampler=sampler, batch_size=args.per_gpu_train_batch_size, collate_fn=collate,
                        num_workers=2, drop_last=True)

    model = RobertaDot(args.model_name_or_path).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    no_decay = ["bias", "LayerNorm.weight", "norm.weight"]
    params = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-8)
    t_total = len(loader) * args.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, t_total)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)
    group = 1 + args.negatives_per_query

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("num examples %d, world %d, total steps %d", len(train_ds), world, t_total)

    global_step, tr_loss = 0, 0.0
    tic = time.time()
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        for qi, qm, di, dm in loader:
            qi, qm, di, dm = qi.to(device), qm.to(device), di.to(device), dm.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                q, d = model(qi, qm, di, dm)
            q_all = all_gather_keep_local(q.float())
            d_all = all_gather_keep_local(d.float())
            scores = q_all @ d_all.t()
            labels = torch.arange(q_all.size(0), device=device) * group
            loss = F.cross_entropy(scores, labels) * world

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            tr_loss += loss.item() / world

            if global_step % args.logging_steps == 0:
                logger.info("step %d loss %.5f lr %.3e %.1fs", global_step, tr_loss / args.logging_steps,
                            scheduler.get_last_lr()[0], time.time() - tic)
                tr_loss, tic = 0.0, time.time()

            if global_step % args.save_steps == 0:
                res = dev_eval(model.module, tok, args, dev, device)
                if rank == 0:
                    logger.info("step %d dev MRR@10 %.4f R@100 %.4f", global_step, *res)
                    ckpt = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                    os.makedirs(ckpt, exist_ok=True)
                    torch.save(model.module.state_dict(), os.path.join(ckpt, "pytorch_model.bin"))
                    tok.save_pretrained(ckpt)
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
