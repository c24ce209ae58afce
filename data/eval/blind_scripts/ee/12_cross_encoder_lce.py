"""Cross-encoder reranker (monoBERT-style) trained with Localized Contrastive Estimation.

Each training group = 1 relevant passage + (group_size - 1) negatives sampled from the
first-stage dense retriever's top-200 for that query. Dev = rerank dense top-100, MRR@10.

  torchrun --nproc_per_node=8 12_cross_encoder_lce.py --train data/lce_groups.jsonl \
      --dev_run runs/dense.dev.top100.trec --out ckpt/reranker-electra
"""
import argparse
import json
import logging
import os
import random
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("reranker")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/electra-base-discriminator")
    ap.add_argument("--train", required=True)
    ap.add_argument("--collection", default="data/collection.tsv")
    ap.add_argument("--queries", default="data/queries.train.tsv")
    ap.add_argument("--dev_queries", default="data/queries.dev.small.tsv")
    ap.add_argument("--dev_qrels", default="data/qrels.dev.small.tsv")
    ap.add_argument("--dev_run", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--per_device_groups", type=int, default=8)
    ap.add_argument("--max_len", type=int, default=224)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--eval_depth", type=int, default=100)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=2023)
    return ap.parse_args()


def read_tsv(path):
    with open(path) as f:
        return dict(l.rstrip("\n").split("\t", 1) for l in f)


class GroupDataset(Dataset):
    def __init__(self, path, queries, collection, group_size):
        self.groups = [json.loads(l) for l in open(path)]
        self.q, self.c, self.g = queries, collection, group_size

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        row = self.groups[i]
        pos = random.choice(row["pos"])
        negs = random.sample(row["neg"], self.g - 1) if len(row["neg"]) >= self.g - 1 \
            else random.choices(row["neg"], k=self.g - 1)
        q = self.q[row["qid"]]
        return [(q, self.c[p]) for p in [pos] + negs]


class PairCollator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, groups):
        pairs = [p for g in groups for p in g]
        return self.tok([q for q, _ in pairs], [d for _, d in pairs], max_length=self.max_len,
                        truncation="only_second", padding=True, return_tensors="pt")


@torch.no_grad()
def rerank_dev(model, tok, args, collection, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev_q = read_tsv(args.dev_queries)
    qrels = defaultdict(set)
    for l in open(args.dev_qrels):
        qid, _, pid, rel = l.split()
        if int(rel) > 0:
            qrels[qid].add(pid)
    run = defaultdict(list)
    for l in open(args.dev_run):
        qid, _, pid, rnk = l.split()[:4]
        if int(rnk) <= args.eval_depth:
            run[qid].append(pid)
    qids = sorted(q for q in run if q in qrels)

    # DistributedSampler pads the last shard with repeated qids; the dict merge below drops them
    sampler = DistributedSampler(qids, shuffle=False)
    model.eval()
    local_rr = {}
    for i in sampler:
        qid = qids[i]
        cands = run[qid]
        enc = tok([dev_q[qid]] * len(cands), [collection[p] for p in cands], max_length=args.max_len,
                  truncation="only_second", padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = model(**enc).logits.squeeze(-1).float()
        top = scores.argsort(descending=True)[:10].tolist()
        local_rr[qid] = next((1.0 / (r + 1) for r, j in enumerate(top) if cands[j] in qrels[qid]), 0.0)
    model.train()

    shards = [None] * world
    dist.all_gather_object(shards, local_rr)
    merged = {}
    for s in shards:
        merged.update(s)
    return sum(merged.values()) / len(merged), len(merged)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    collection = read_tsv(args.collection)
    ds = GroupDataset(args.train, read_tsv(args.queries), collection, args.group_size)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.per_device_groups, sampler=sampler, num_workers=4,
                    collate_fn=PairCollator(tok, args.max_len), drop_last=True, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    ddp = DDP(model, device_ids=[local_rank], output_device=local_rank)

    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    steps = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup_ratio * steps), steps)

    start_epoch, best = 0, 0.0
    if args.resume:
        state = torch.load(os.path.join(args.resume, "train_state.pt"), map_location="cpu")
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, best = state["epoch"] + 1, state["best"]
        log.info("resumed from %s (epoch %d)", args.resume, state["epoch"])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        log.info("groups=%d world=%d steps=%d", len(ds), world, steps)

    target = torch.zeros(args.per_device_groups, dtype=torch.long, device=device)  # positive is first
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for it, batch in enumerate(dl):
            batch = batch.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(**batch).logits
            loss = F.cross_entropy(logits.float().view(-1, args.group_size), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if it % 200 == 0:
                log.info("epoch %d it %d/%d loss %.4f", epoch, it, len(dl), loss.item())

        mrr, n = rerank_dev(ddp.module, tok, args, collection, device)
        log.info("epoch %d dev MRR@10 %.4f over %d queries", epoch, mrr, n)
        if rank == 0:
            if mrr > best:
                best = mrr
                ddp.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, os.path.join(args.out, "train_state.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
