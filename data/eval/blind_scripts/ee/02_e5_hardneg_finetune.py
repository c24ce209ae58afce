"""Fine-tune a shared (siamese) mean-pooled encoder with mined hard negatives.

Data: jsonl {"qid", "query", "pos": [pid, ...], "neg": [pid, ...]} + collection.tsv
Eval: encode dev collection across all ranks, exact IP search on rank 0.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    02_e5_hardneg_finetune.py --config configs/e5_base_msmarco.yaml
"""
import argparse
import json
import logging
import os
import random
from collections import defaultdict

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)

DEFAULTS = dict(
    model="intfloat/e5-base-unsupervised",
    train="/shared/msmarco/train.mined.jsonl",
    collection="/shared/msmarco/collection.tsv",
    dev_queries="/shared/msmarco/dev.small.queries.tsv",
    dev_qrels="/shared/msmarco/qrels.dev.small.tsv",
    dev_pool="/shared/msmarco/dev.small.pool.tsv",
    out="/shared/ckpt/e5-msmarco",
    batch_size=64,
    group_size=8,
    lr=2e-5,
    warmup=1000,
    epochs=2,
    tau=0.02,
    q_len=32,
    p_len=192,
    save_every=2000,
    seed=17,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def read_collection(path, keep=None):
    docs = {}
    with open(path) as f:
        for line in f:
            pid, text = line.rstrip("\n").split("\t", 1)
            if keep is None or pid in keep:
                docs[pid] = text
    return docs


class MinedTriples(Dataset):
    def __init__(self, path, collection, group_size):
        self.rows = [json.loads(l) for l in open(path)]
        self.docs = collection
        self.group_size = group_size
        self.epoch = 0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        rng = random.Random(hash((i, self.epoch)))
        pos = rng.choice(r["pos"])
        k = self.group_size - 1
        negs = rng.sample(r["neg"], k) if len(r["neg"]) >= k else rng.choices(r["neg"], k=k)
        return "query: " + r["query"], ["passage: " + self.docs[p] for p in [pos] + negs]


def mean_pool(hidden, mask):
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-6)


class Encoder(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, input_ids, attention_mask):
        h = self.lm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return F.normalize(mean_pool(h, attention_mask), dim=-1)

    def forward(self, qs, ps):
        return self.encode(qs["input_ids"], qs["attention_mask"]), self.encode(ps["input_ids"], ps["attention_mask"])


def all_gather_grad(x):
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x
    return torch.cat(out)


def all_gather_uneven(x):
    """Gather [n_i, d] tensors whose n_i differ across ranks (eval only)."""
    n = torch.tensor([x.size(0)], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    pad = x.new_zeros((max(sizes) - x.size(0), x.size(1)))
    buf = [x.new_zeros((max(sizes), x.size(1))) for _ in sizes]
    dist.all_gather(buf, torch.cat([x, pad]))
    return torch.cat([b[:s] for b, s in zip(buf, sizes)])


@torch.no_grad()
def embed(model, tok, texts, max_len, device, bs=512):
    chunks = []
    for i in range(0, len(texts), bs):
        t = tok(texts[i:i + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            chunks.append(model.encode(t["input_ids"], t["attention_mask"]).float())
    return torch.cat(chunks) if chunks else torch.zeros((0, model.lm.config.hidden_size), device=device)


def evaluate(enc, tok, cfg, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    pool_pids = sorted({l.split("\t")[1].strip() for l in open(cfg.dev_pool)})
    docs = read_collection(cfg.collection, keep=set(pool_pids))
    my_pids = pool_pids[rank::world]
    p_emb = all_gather_uneven(embed(enc, tok, ["passage: " + docs[p] for p in my_pids], cfg.p_len, device))
    all_pids = [p for r in range(world) for p in pool_pids[r::world]]

    result = torch.zeros(2, device=device)
    if rank == 0:
        queries = [l.rstrip("\n").split("\t") for l in open(cfg.dev_queries)]
        qrels = defaultdict(set)
        for l in open(cfg.dev_qrels):
            qid, _, pid, _ = l.split()
            qrels[qid].add(pid)
        q_emb = embed(enc, tok, ["query: " + q for _, q in queries], cfg.q_len, device)
        index = faiss.IndexFlatIP(p_emb.size(1))
        index.add(p_emb.cpu().numpy())
        _, topk = index.search(q_emb.cpu().numpy(), 1000)
        mrr, recall = 0.0, 0.0
        for (qid, _), row in zip(queries, topk):
            ranked = [all_pids[j] for j in row]
            mrr += next((1.0 / (i + 1) for i, p in enumerate(ranked[:10]) if p in qrels[qid]), 0.0)
            recall += len(qrels[qid] & set(ranked)) / max(len(qrels[qid]), 1)
        result = torch.tensor([mrr / len(queries), recall / len(queries)], device=device)
    dist.broadcast(result, src=0)
    return {"MRR@10": result[0].item(), "R@1k": result[1].item()}


def save_state(path, model, opt, sched, step, epoch):
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "step": step, "epoch": epoch}, path + ".tmp")
    os.replace(path + ".tmp", path)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)
    torch.manual_seed(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.model)
    docs = read_collection(cfg.collection)
    ds = MinedTriples(cfg.train, docs, cfg.group_size)

    def collate(batch):
        qs = tok([q for q, _ in batch], max_length=cfg.q_len, truncation=True, padding=True, return_tensors="pt")
        ps = tok([p for _, g in batch for p in g], max_length=cfg.p_len, truncation=True, padding=True,
                 return_tensors="pt")
        return qs, ps

    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, num_workers=6,
                    drop_last=True, pin_memory=True)

    enc = Encoder(cfg.model).to(device)
    model = DDP(enc, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    total = len(dl) * cfg.epochs
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup, total)

    step, start_epoch = 0, 0
    if cfg.resume:
        state = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, start_epoch = state["step"], state["epoch"] + 1
        log.info("resumed from %s at step %d", cfg.resume, step)

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        ds.epoch = epoch
        model.train()
        for qs, ps in dl:
            qs, ps = qs.to(device), ps.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, p = model(qs, ps)
            q, p = all_gather_grad(q.float()), all_gather_grad(p.float())
            logits = q @ p.T / cfg.tau
            labels = torch.arange(q.size(0), device=device) * cfg.group_size
            loss = F.cross_entropy(logits, labels) * world

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                log.info("ep %d step %d/%d loss %.4f", epoch, step, total, loss.item() / world)
            if step % cfg.save_every == 0 and rank == 0:
                save_state(os.path.join(cfg.out, "last.pt"), model, opt, sched, step, epoch - 1)

        model.eval()
        metrics = evaluate(model.module, tok, cfg, device)
        log.info("epoch %d %s", epoch, metrics)
        if rank == 0:
            save_state(os.path.join(cfg.out, "last.pt"), model, opt, sched, step, epoch)
            model.module.lm.save_pretrained(os.path.join(cfg.out, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(cfg.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
