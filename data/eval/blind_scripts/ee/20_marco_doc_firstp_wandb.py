"""MS MARCO document ranking, FirstP dense retriever (first 512 tokens of url+title+body).

Trained on dev-style hard negatives from the HDCT/BM25 top-100; evaluated with MRR@100 on
msmarco-doc dev (sub-sampled) and nDCG@10 on TREC DL'19 against a pooled candidate set.
Metrics and curves go to W&B.

  torchrun --nproc_per_node=8 20_marco_doc_firstp_wandb.py --data /data/marco-doc --out /data/runs/doc-firstp
"""
import argparse
import json
import logging
import math
import os
import random
from collections import defaultdict

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("docfirstp")


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="Luyu/co-condenser-marco")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--negs", type=int, default=3)
    ap.add_argument("--q_len", type=int, default=32)
    ap.add_argument("--d_len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--log_every", type=int, default=20)
    ap.add_argument("--wandb_project", default="dense-doc-retrieval")
    ap.add_argument("--run_name", default=None)
    return ap.parse_args()


def doc_text(d):
    return f"{d['url']} {d['title']} {d['body'][:4000]}"


class DocTriples(Dataset):
    def __init__(self, path, queries, docs, negs):
        self.rows = [json.loads(l) for l in open(path)]
        self.queries, self.docs, self.negs = queries, docs, negs

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pool = [d for d in r["negatives"] if d in self.docs]
        negs = random.sample(pool, self.negs) if len(pool) >= self.negs else random.choices(pool, k=self.negs)
        return self.queries[r["qid"]], [doc_text(self.docs[d]) for d in [r["pos"]] + negs]


class FirstP(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, b):
        return self.lm(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state[:, 0]

    def forward(self, q, d):
        return self.encode(q), self.encode(d)


def gather_grad_local(x):
    xs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x.contiguous())
    xs[dist.get_rank()] = x
    return torch.cat(xs)


@torch.no_grad()
def encode(model, tok, texts, max_len, device, bs=128):
    out = []
    for s in range(0, len(texts), bs):
        b = tok(texts[s:s + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(model.encode(b).float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, 768), "float32")


def ndcg_at_10(ranked, judged):
    dcg = sum((2 ** judged.get(d, 0) - 1) / math.log2(i + 2) for i, d in enumerate(ranked[:10]))
    ideal = sorted(judged.values(), reverse=True)[:10]
    idcg = sum((2 ** g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def evaluate(model, tok, args, docs, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    pool_ids = sorted(json.load(open(os.path.join(args.data, "eval_pool.json"))))
    mine = pool_ids[rank::world]
    parts = [None] * world
    dist.all_gather_object(parts, (mine, encode(model, tok, [doc_text(docs[d]) for d in mine], args.d_len, device)))
    res = None
    if rank == 0:
        order = [d for p in parts for d in p[0]]
        index = faiss.IndexFlatIP(parts[0][1].shape[1])
        index.add(np.concatenate([p[1] for p in parts]).astype("float32"))
        res = {}
        for name in ("dev", "dl19"):
            qs = [l.rstrip("\n").split("\t") for l in open(os.path.join(args.data, f"{name}.queries.tsv"))]
            judged = defaultdict(dict)
            for l in open(os.path.join(args.data, f"{name}.qrels")):
                qid, _, did, g = l.split()
                judged[qid][did] = int(g)
            _, I = index.search(encode(model, tok, [q for _, q in qs], args.q_len, device), 100)
            if name == "dev":
                rr = [next((1 / (k + 1) for k, j in enumerate(row) if judged[qid].get(order[j], 0) > 0), 0.0)
                      for (qid, _), row in zip(qs, I)]
                res["dev/MRR@100"] = float(np.mean(rr))
            else:
                res["dl19/nDCG@10"] = float(np.mean([ndcg_at_10([order[j] for j in row], judged[qid])
                                                     for (qid, _), row in zip(qs, I)]))
    model.train()
    return res


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(rank)
    torch.manual_seed(0)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    docs = {}
    with open(os.path.join(args.data, "docs.jsonl")) as f:
        for line in f:
            d = json.loads(line)
            docs[d["docid"]] = d
    queries = dict(l.rstrip("\n").split("\t") for l in open(os.path.join(args.data, "train.queries.tsv")))
    tok = AutoTokenizer.from_pretrained(args.model)

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=args.q_len, truncation=True, padding=True, return_tensors="pt")
        d = tok([x for b in batch for x in b[1]], max_length=args.d_len, truncation=True, padding=True,
                return_tensors="pt")
        return q, d

    ds = DocTriples(os.path.join(args.data, "train.hn.jsonl"), queries, docs, args.negs)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)

    model = DDP(FirstP(args.model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    group = 1 + args.negs

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, best = 0, -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for q, d in dl:
            q, d = q.to(device), d.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qv, dv = model(q, d)
            qv, dv = gather_grad_local(qv.float()), gather_grad_local(dv.float())
            scores = qv @ dv.t()
            target = torch.arange(qv.size(0), device=device) * group
            loss = F.cross_entropy(scores, target) * world
            acc = (scores.argmax(1) == target).float().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0:
                wandb.log({"train/loss": loss.item() / world, "train/acc": acc.item(),
                           "train/lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

            if step % args.eval_every == 0:
                res = evaluate(model.module, tok, args, docs, device)
                if rank == 0:
                    logger.info("step %d %s", step, res)
                    wandb.log(res, step=step)
                    if res["dev/MRR@100"] > best:
                        best = res["dev/MRR@100"]
                        model.module.lm.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()

    if rank == 0:
        model.module.lm.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
