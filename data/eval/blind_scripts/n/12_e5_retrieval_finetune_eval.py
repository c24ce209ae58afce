#!/usr/bin/env python
"""
multilingual-e5 fine-tune for our support-ticket search.
MultipleNegativesRanking loss w/ cross-GPU negatives, dev eval = Recall@10 / MRR@10 on held-out queries
against the full KB corpus; keeps the best checkpoint.

    torchrun --nproc_per_node=8 12_e5_retrieval_finetune_eval.py --train pairs_train.jsonl \
        --dev_queries dev_q.jsonl --corpus kb.jsonl --out runs/e5-kb
"""
import argparse
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
log = logging.getLogger("e5ft")


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="intfloat/multilingual-e5-base")
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev_queries", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--scale", type=float, default=50.0)
    ap.add_argument("--max_len", type=int, default=192)
    ap.add_argument("--eval_steps", type=int, default=500)
    ap.add_argument("--wandb_project", default="kb-search")
    return ap.parse_args()


class Jsonl(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l) for l in open(path, encoding="utf-8")]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def mean_pool(h, mask):
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


class E5(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.bert = AutoModel.from_pretrained(name)

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(mean_pool(h, attention_mask), dim=-1)


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        n = g.shape[0] // dist.get_world_size()
        return g[dist.get_rank() * n : (dist.get_rank() + 1) * n]


@torch.no_grad()
def encode(model, tok, texts, device, bs=256, max_len=192):
    embs = []
    for i in range(0, len(texts), bs):
        t = tok(texts[i : i + bs], padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            embs.append(model(t["input_ids"], t["attention_mask"]).float())
    return torch.cat(embs)


@torch.no_grad()
def evaluate(model, tok, dev_loader, corpus, device, k=10):
    model.eval()
    corpus_ids = [c["id"] for c in corpus]
    c_emb = encode(model, tok, ["passage: " + c["text"] for c in corpus], device)
    hits, rr, n = 0.0, 0.0, 0
    for batch in dev_loader:
        q_emb = encode(model, tok, ["query: " + q for q in batch["query"]], device)
        topk = (q_emb @ c_emb.T).topk(k, dim=1).indices.tolist()
        for row, gold in zip(topk, batch["pos_id"]):
            ranked = [corpus_ids[j] for j in row]
            if gold in ranked:
                hits += 1
                rr += 1.0 / (ranked.index(gold) + 1)
            n += 1
    model.train()
    return {"recall@10": hits / n, "mrr@10": rr / n}


def main():
    a = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    device = torch.device("cuda", lr_)

    tok = AutoTokenizer.from_pretrained(a.base)
    model = DDP(E5(a.base).to(device), device_ids=[lr_])

    train_ds = Jsonl(a.train)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.bs, sampler=sampler, drop_last=True, num_workers=2,
                          collate_fn=lambda b: b)
    dev_ds = Jsonl(a.dev_queries)
    dev_dl = DataLoader(dev_ds, batch_size=256, sampler=DistributedSampler(dev_ds, shuffle=False),
                        collate_fn=lambda b: {"query": [x["query"] for x in b], "pos_id": [x["pos_id"] for x in b]})
    corpus = Jsonl(a.corpus).rows

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = len(train_dl) * a.epochs
    sch = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        wandb.init(project=a.wandb_project, config=vars(a), name=os.path.basename(a.out))

    best, step = -1.0, 0
    for ep in range(a.epochs):
        sampler.set_epoch(ep)
        for batch in train_dl:
            q = tok(["query: " + r["query"] for r in batch], padding=True, truncation=True, max_length=a.max_len,
                    return_tensors="pt").to(device)
            p = tok(["passage: " + r["pos"] for r in batch], padding=True, truncation=True, max_length=a.max_len,
                    return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qe = model(q["input_ids"], q["attention_mask"]).float()
                pe = model(p["input_ids"], p["attention_mask"]).float()
            all_p = AllGather.apply(pe)
            scores = a.scale * qe @ all_p.T
            labels = torch.arange(qe.shape[0], device=device) + rank * qe.shape[0]
            loss = F.cross_entropy(scores, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sch.step(); opt.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": sch.get_last_lr()[0]}, step=step)

            if step % a.eval_steps == 0 or step == total:
                metrics = evaluate(model.module, tok, dev_dl, corpus, device)
                if rank == 0:
                    log.info(f"step {step}: {metrics}")
                    wandb.log({f"dev/{k}": v for k, v in metrics.items()}, step=step)
                    if metrics["mrr@10"] > best:
                        best = metrics["mrr@10"]
                        model.module.bert.save_pretrained(os.path.join(a.out, "best"))
                        tok.save_pretrained(os.path.join(a.out, "best"))
                        log.info(f"new best mrr@10 {best:.4f}")
                dist.barrier()

    if rank == 0:
        wandb.summary["best_mrr@10"] = best
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
