"""Bi-encoder fine-tuning for product search (query -> product title/description).

Contrastive loss with in-batch negatives gathered from all ranks.
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        03_search_embeddings.py --config configs/search_bi_encoder.yaml
"""
import argparse
import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("bi_encoder")


@dataclass
class TrainConfig:
    model_name: str = "sentence-transformers/all-MiniLM-L12-v2"
    train_file: str = "data/query_product_pairs.jsonl"
    eval_queries: str = "data/eval_queries.jsonl"
    eval_corpus: str = "data/eval_corpus.jsonl"
    max_len: int = 64
    per_device_batch: int = 128
    grad_accum: int = 2
    lr: float = 2e-5
    temperature: float = 0.05
    epochs: int = 3
    warmup_ratio: float = 0.05
    output_dir: str = "out/bi_encoder"


def mean_pool(hidden, attention_mask):
    mask = attention_mask.unsqueeze(-1).type_as(hidden)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-6)


class BiEncoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)

    def forward(self, input_ids, attention_mask):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return F.normalize(mean_pool(out.last_hidden_state, attention_mask), dim=-1)


def contrastive_loss(q, d, temperature, rank):
    # differentiable all_gather so every rank gets gradients for its own embeddings
    all_d = torch.cat(dist_fn.all_gather(d), dim=0)
    logits = q @ all_d.T / temperature
    labels = torch.arange(q.size(0), device=q.device) + rank * q.size(0)
    return F.cross_entropy(logits, labels)


@torch.no_grad()
def gather_uneven(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """all_gather for tensors whose first dim differs per rank: pad to the max, gather, trim."""
    n = torch.tensor([t.size(0)], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.size(0)] = t
    out = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)], dim=0)


@torch.no_grad()
def encode(model, tok, texts, device, max_len, bs=512):
    embs = []
    for i in range(0, len(texts), bs):
        enc = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
        embs.append(model(enc["input_ids"], enc["attention_mask"]))
    return torch.cat(embs) if embs else torch.empty(0, model.encoder.config.hidden_size, device=device)


@torch.no_grad()
def evaluate_recall(model, tok, cfg, device, rank, world_size, k=10):
    model.eval()
    corpus = [json.loads(l) for l in open(cfg.eval_corpus)]
    queries = [json.loads(l) for l in open(cfg.eval_queries)]
    shard = corpus[rank::world_size]
    doc_emb = gather_uneven(encode(model, tok, [d["text"] for d in shard], device, cfg.max_len), world_size)
    # undo the strided sharding so row i corresponds to corpus[i]
    order = torch.cat([torch.arange(r, len(corpus), world_size) for r in range(world_size)]).to(device)
    docs = torch.empty_like(doc_emb)
    docs[order] = doc_emb
    recall = 0.0
    if rank == 0:
        q_emb = encode(model, tok, [q["text"] for q in queries], device, cfg.max_len)
        topk = (q_emb @ docs.T).topk(k, dim=-1).indices.cpu()
        hits = [int(q["pos_idx"]) in set(row.tolist()) for q, row in zip(queries, topk)]
        recall = sum(hits) / max(len(hits), 1)
    model.train()
    return recall


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    cfg = TrainConfig(**yaml.safe_load(open(p.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    # let rank 0 download / build the cache first, everyone else then reads it
    if rank != 0:
        dist.barrier()
    tok = AutoTokenizer.from_pretrained(cfg.model_name)
    ds = load_dataset("json", data_files=cfg.train_file, split="train")
    if rank == 0:
        dist.barrier()

    def collate(rows):
        q = tok([r["query"] for r in rows], padding=True, truncation=True, max_length=cfg.max_len, return_tensors="pt")
        d = tok([r["product_text"] for r in rows], padding=True, truncation=True, max_length=cfg.max_len, return_tensors="pt")
        return q, d

    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.per_device_batch, sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True)

    model = DDP(BiEncoder(cfg.model_name).to(device), device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    steps = math.ceil(len(loader) / cfg.grad_accum) * cfg.epochs
    sched = get_linear_schedule_with_warmup(optim, int(cfg.warmup_ratio * steps), steps)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for step, (q, d) in enumerate(loader):
            q, d = q.to(device), d.to(device)
            sync_now = (step + 1) % cfg.grad_accum == 0
            ctx = contextlib.nullcontext() if sync_now else model.no_sync()
            with ctx:
                q_emb = model(q["input_ids"], q["attention_mask"])
                d_emb = model(d["input_ids"], d["attention_mask"])
                loss = contrastive_loss(q_emb, d_emb, cfg.temperature, rank) / cfg.grad_accum
                loss.backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                sched.step()
                optim.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item() * cfg.grad_accum)

        recall = evaluate_recall(model.module, tok, cfg, device, rank, world_size)
        if rank == 0:
            logger.info("epoch %d recall@10 %.4f", epoch, recall)
            os.makedirs(cfg.output_dir, exist_ok=True)
            model.module.encoder.save_pretrained(os.path.join(cfg.output_dir, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(cfg.output_dir, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
