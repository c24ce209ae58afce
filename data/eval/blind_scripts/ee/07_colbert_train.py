"""ColBERT (late interaction) training on MS MARCO triples with gradient accumulation.

Each rank sees `bsize // accum` queries per micro-step: 1 positive + n_way-1 hard negatives,
plus the other queries' passages on the same rank as in-batch negatives.
Dev: MaxSim rerank of BM25 top-100 (queries sharded over ranks, MRR@10 summed).
At the end rank 0 samples token embeddings and trains the IVF centroids for the PLAID index.

  torchrun --nproc_per_node=8 07_colbert_train.py --triples data/triples.hn.jsonl \
      --collection data/collection.tsv --queries data/queries.train.tsv --root experiments/colbert-hn
"""
import argparse
import datetime
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, BertModel, BertPreTrainedModel, get_linear_schedule_with_warmup

log = logging.getLogger("colbert")


class ColBERT(BertPreTrainedModel):
    def __init__(self, config, dim=128):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.linear = nn.Linear(config.hidden_size, dim, bias=False)
        self.post_init()

    def query(self, ids, mask):
        q = self.linear(self.bert(ids, attention_mask=mask).last_hidden_state)
        return F.normalize(q, p=2, dim=2)

    def doc(self, ids, mask):
        d = self.linear(self.bert(ids, attention_mask=mask).last_hidden_state)
        d = d * mask.unsqueeze(2).float()  # zero out padding tokens
        return F.normalize(d, p=2, dim=2)

    @staticmethod
    def maxsim(q, d):
        # q: [Q, Lq, dim], d: [D, Ld, dim] -> [Q, D]
        return torch.einsum("qid,pjd->qpij", q, d).max(-1).values.sum(-1)

    def forward(self, q_ids, q_mask, d_ids, d_mask):
        return self.maxsim(self.query(q_ids, q_mask), self.doc(d_ids, d_mask))


class Tokenizers:
    def __init__(self, name, q_len, d_len):
        self.tok = AutoTokenizer.from_pretrained(name)
        self.q_len, self.d_len = q_len, d_len
        self.q_marker, self.d_marker = "[unused0]", "[unused1]"

    def queries(self, qs):
        # query augmentation: pad with [MASK] up to q_len and attend to them
        t = self.tok([f"{self.q_marker} {q}" for q in qs], max_length=self.q_len, truncation=True,
                     padding="max_length", return_tensors="pt")
        ids = t["input_ids"]
        ids[ids == self.tok.pad_token_id] = self.tok.mask_token_id
        return ids, torch.ones_like(ids)

    def docs(self, ds):
        t = self.tok([f"{self.d_marker} {d}" for d in ds], max_length=self.d_len, truncation=True,
                     padding="longest", return_tensors="pt")
        return t["input_ids"], t["attention_mask"]


class Triples(Dataset):
    def __init__(self, path, queries, collection, n_way):
        self.rows = [json.loads(l) for l in open(path)]
        self.queries, self.collection, self.n_way = queries, collection, n_way

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        qid, pos, *negs = self.rows[i]
        negs = random.sample(negs, self.n_way - 1) if len(negs) >= self.n_way - 1 else \
            random.choices(negs, k=self.n_way - 1)
        return self.queries[qid], [self.collection[p] for p in [pos] + negs]


def read_tsv(path):
    out = {}
    with open(path) as f:
        for line in f:
            k, v = line.rstrip("\n").split("\t")[:2]
            out[k] = v
    return out


@torch.no_grad()
def dev_rerank(colbert, toks, args, collection, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    queries = read_tsv(args.dev_queries)
    qrels = defaultdict(set)
    for l in open(args.dev_qrels):
        a = l.split()
        qrels[a[0]].add(a[2])
    top = defaultdict(list)
    for l in open(args.dev_top100):
        qid, pid = l.split()[:2]
        top[qid].append(pid)
    qids = sorted(q for q in top if q in qrels)

    colbert.eval()
    stats = torch.zeros(2, dtype=torch.float64, device=device)  # [sum RR@10, n]
    for qid in qids[rank::world]:
        cands = top[qid]
        qi, qm = toks.queries([queries[qid]])
        di, dm = toks.docs([collection[p] for p in cands])
        with torch.autocast("cuda", dtype=torch.float16):
            s = colbert(qi.to(device), qm.to(device), di.to(device), dm.to(device))[0].float()
        order = s.argsort(descending=True)[:10].tolist()
        rr = next((1.0 / (r + 1) for r, j in enumerate(order) if cands[j] in qrels[qid]), 0.0)
        stats[0] += rr
        stats[1] += 1
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    colbert.train()
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def train_centroids(colbert, toks, collection, out_dir, device, sample_docs=50_000, n_centroids=16384):
    pids = random.Random(0).sample(list(collection), min(sample_docs, len(collection)))
    embs = []
    for s in range(0, len(pids), 512):
        di, dm = toks.docs([collection[p] for p in pids[s:s + 512]])
        di, dm = di.to(device), dm.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            d = colbert.doc(di, dm)
        embs.append(d[dm.bool()].float().cpu().numpy())
    x = np.concatenate(embs)
    log.info("training %d centroids on %d token embeddings", n_centroids, x.shape[0])
    km = faiss.Kmeans(x.shape[1], n_centroids, niter=20, seed=123, spherical=True)
    km.train(x)
    np.save(os.path.join(out_dir, "centroids.npy"), km.centroids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--triples", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--collection", required=True)
    ap.add_argument("--dev_queries", default="data/queries.dev.small.tsv")
    ap.add_argument("--dev_qrels", default="data/qrels.dev.small.tsv")
    ap.add_argument("--dev_top100", default="data/bm25.dev.small.top100.tsv")
    ap.add_argument("--root", required=True)
    ap.add_argument("--checkpoint", default="bert-base-uncased")
    ap.add_argument("--bsize", type=int, default=32, help="queries per rank per optimizer step")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--n_way", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--maxsteps", type=int, default=400_000)
    ap.add_argument("--warmup", type=int, default=20_000)
    ap.add_argument("--eval_every", type=int, default=25_000)
    ap.add_argument("--query_maxlen", type=int, default=32)
    ap.add_argument("--doc_maxlen", type=int, default=180)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 trains the PLAID centroids at the end while the others wait in barrier()
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[{rank}] %(asctime)s %(message)s")
    random.seed(12345 + rank)
    torch.manual_seed(12345)

    toks = Tokenizers(args.checkpoint, args.query_maxlen, args.doc_maxlen)
    collection = read_tsv(args.collection)
    ds = Triples(args.triples, read_tsv(args.queries), collection, args.n_way)
    micro = args.bsize // args.accum
    sampler = DistributedSampler(ds, shuffle=True, seed=12345, drop_last=True)

    def collate(batch):
        qi, qm = toks.queries([b[0] for b in batch])
        di, dm = toks.docs([d for b in batch for d in b[1]])
        return qi, qm, di, dm

    loader = DataLoader(ds, batch_size=micro, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)

    colbert = ColBERT.from_pretrained(args.checkpoint).to(device)
    model = DDP(colbert, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    sched = get_linear_schedule_with_warmup(opt, args.warmup, args.maxsteps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.root, exist_ok=True)

    step, micro_step, epoch = 0, 0, 0
    while step < args.maxsteps:
        sampler.set_epoch(epoch)
        for qi, qm, di, dm in loader:
            qi, qm, di, dm = qi.to(device), qm.to(device), di.to(device), dm.to(device)
            sync_now = (micro_step + 1) % args.accum == 0
            labels = torch.arange(qi.size(0), device=device) * args.n_way
            if sync_now:
                with torch.autocast("cuda", dtype=torch.float16):
                    scores = model(qi, qm, di, dm)
                loss = F.cross_entropy(scores.float(), labels) / args.accum
                scaler.scale(loss).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        scores = model(qi, qm, di, dm)
                    loss = F.cross_entropy(scores.float(), labels) / args.accum
                    scaler.scale(loss).backward()
            micro_step += 1
            if not sync_now:
                continue

            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 500 == 0:
                log.info("step %d loss %.4f lr %.2e", step, loss.item() * args.accum, sched.get_last_lr()[0])
            if step % args.eval_every == 0:
                mrr = dev_rerank(model.module, toks, args, collection, device)
                log.info("step %d dev MRR@10 %.4f", step, mrr)
                if rank == 0:
                    model.module.save_pretrained(os.path.join(args.root, f"colbert-{step}"))
                    toks.tok.save_pretrained(os.path.join(args.root, f"colbert-{step}"))
                dist.barrier()
            if step >= args.maxsteps:
                break
        epoch += 1

    if rank == 0:
        final = os.path.join(args.root, "colbert-final")
        model.module.save_pretrained(final)
        toks.tok.save_pretrained(final)
        train_centroids(model.module, toks, collection, final, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
