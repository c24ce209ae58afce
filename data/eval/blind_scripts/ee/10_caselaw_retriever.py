"""Case-law passage retriever (bi-encoder, legal-bert) with BM25 hard negatives.

Queries are fact summaries, documents are paragraphs of prior decisions. Evaluated on
the held-out dev topics with Recall@{20,100} and MRR@10 over the dev paragraph pool.

  torchrun --nproc_per_node=4 10_caselaw_retriever.py --data /mnt/legal/retrieval_v2 \
      --out /mnt/legal/runs/caselaw-dense-v2
"""
import argparse
import glob
import json
import logging
import math
import os
import random
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("caselaw")


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--base", default="nlpaueb/legal-bert-base-uncased")
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--hard", type=int, default=2)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=float, default=0.06)
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--qlen", type=int, default=128)
    p.add_argument("--dlen", type=int, default=384)
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


class LegalPairs(Dataset):
    def __init__(self, rows, paragraphs, hard):
        self.rows, self.paras, self.hard = rows, paragraphs, hard

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pos = random.choice(r["relevant"])
        negs = r["bm25_negatives"]
        negs = random.sample(negs, self.hard) if len(negs) >= self.hard else random.choices(negs, k=self.hard)
        return r["summary"], [self.paras[x] for x in [pos] + negs]


class Retriever(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.bert = AutoModel.from_pretrained(base, add_pooling_layer=False)

    def rep(self, enc):
        return F.normalize(self.bert(**enc).last_hidden_state[:, 0], dim=-1)

    def forward(self, q, d):
        return self.rep(q), self.rep(d)


def gather(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    out[dist.get_rank()] = x
    return torch.cat(out)


@torch.no_grad()
def embed(model, tok, texts, maxlen, device, bs=128):
    chunks = []
    for i in range(0, len(texts), bs):
        enc = tok(texts[i:i + bs], truncation=True, max_length=maxlen, padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            chunks.append(model.rep(enc).float())
    return torch.cat(chunks)


def pad_gather(x, n_total):
    """all_gather for row-sharded tensors where shards differ by at most one row."""
    world = dist.get_world_size()
    per = math.ceil(n_total / world)
    padded = torch.zeros(per, x.size(1), device=x.device, dtype=x.dtype)
    padded[: x.size(0)] = x
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded)
    sizes = [len(range(r, n_total, world)) for r in range(world)]
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)])


def evaluate(model, tok, dev, pool, args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    pids = sorted(pool)
    order = [p for r in range(world) for p in pids[r::world]]
    d_emb = pad_gather(embed(model, tok, [pool[p] for p in pids[rank::world]], args.dlen, device), len(pids))
    res = torch.zeros(3, device=device)
    if rank == 0:
        q_emb = embed(model, tok, [r["summary"] for r in dev], args.qlen, device)
        top = (q_emb @ d_emb.t()).topk(100, dim=1).indices.cpu().tolist()
        for r, row in zip(dev, top):
            gold = set(r["relevant"])
            ranked = [order[j] for j in row]
            res[0] += len(gold & set(ranked[:20])) / len(gold)
            res[1] += len(gold & set(ranked)) / len(gold)
            res[2] += next((1.0 / (k + 1) for k, p in enumerate(ranked[:10]) if p in gold), 0.0)
        res /= len(dev)
    dist.broadcast(res, 0)
    model.train()
    return {"R@20": res[0].item(), "R@100": res[1].item(), "MRR@10": res[2].item()}


def save_checkpoint(out, epoch, model, tok, opt, sched, metrics, keep_last):
    ckpt_dir = os.path.join(out, f"epoch-{epoch:02d}")
    os.makedirs(ckpt_dir, exist_ok=True)
    model.module.bert.save_pretrained(ckpt_dir)
    tok.save_pretrained(ckpt_dir)
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch},
               os.path.join(ckpt_dir, "trainer_state.pt"))
    with open(os.path.join(ckpt_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    old = sorted(glob.glob(os.path.join(out, "epoch-*")))[:-keep_last]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    paragraphs = {r["pid"]: r["text"] for r in read_jsonl(os.path.join(args.data, "paragraphs.jsonl"))}
    train_rows = read_jsonl(os.path.join(args.data, "train.jsonl"))
    dev_rows = read_jsonl(os.path.join(args.data, "dev.jsonl"))
    dev_pool = {p: paragraphs[p] for p in json.load(open(os.path.join(args.data, "dev_pool.json")))}

    tok = AutoTokenizer.from_pretrained(args.base)

    def collate(batch):
        q = tok([b[0] for b in batch], truncation=True, max_length=args.qlen, padding=True, return_tensors="pt")
        d = tok([x for b in batch for x in b[1]], truncation=True, max_length=args.dlen, padding=True,
                return_tensors="pt")
        return q, d

    ds = LegalPairs(train_rows, paragraphs, args.hard)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)

    model = DDP(Retriever(args.base).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(args.warmup * total), total)

    start_epoch = 0
    if args.resume:
        last = sorted(glob.glob(os.path.join(args.out, "epoch-*")))
        if last:
            model.module.bert.load_state_dict(
                AutoModel.from_pretrained(last[-1], add_pooling_layer=False).state_dict())
            st = torch.load(os.path.join(last[-1], "trainer_state.pt"), map_location="cpu")
            opt.load_state_dict(st["opt"])
            sched.load_state_dict(st["sched"])
            start_epoch = st["epoch"] + 1
            log.info("resuming from %s", last[-1])

    group = 1 + args.hard
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (q, d) in enumerate(dl):
            q, d = q.to(device), d.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qv, dv = model(q, d)
            qv, dv = gather(qv.float()), gather(dv.float())
            loss = F.cross_entropy(qv @ dv.t() / args.tau, torch.arange(qv.size(0), device=device) * group) * world
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if i % 50 == 0:
                log.info("epoch %d it %d loss %.4f", epoch, i, loss.item() / world)

        metrics = evaluate(model.module, tok, dev_rows, dev_pool, args, device)
        log.info("epoch %d %s", epoch, metrics)
        save_checkpoint(args.out, epoch, model, tok, opt, sched, metrics, args.keep_last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
