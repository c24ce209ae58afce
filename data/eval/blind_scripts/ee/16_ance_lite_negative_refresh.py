"""Dense retriever with periodic hard-negative refresh ("ANCE-lite").

Epoch 0 trains on BM25 negatives. After every epoch the current model re-encodes the
MS MARCO collection, builds a FAISS index, and mines new negatives (ranks 30-200 of the
dense run, minus positives) for the next epoch.

  torchrun --nproc_per_node=8 16_ance_lite_negative_refresh.py --work_dir /shared/ance_lite \
      --collection /shared/marco/collection.tsv --train_queries /shared/marco/queries.train.tsv \
      --train_qrels /shared/marco/qrels.train.tsv --bm25_negs /shared/marco/train.bm25.negs.tsv
"""
import argparse
import logging
import os
import random
import time
from collections import defaultdict

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger("ance_lite")


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work_dir", required=True)
    ap.add_argument("--collection", required=True)
    ap.add_argument("--train_queries", required=True)
    ap.add_argument("--train_qrels", required=True)
    ap.add_argument("--bm25_negs", required=True, help="qid \\t pid,pid,...")
    ap.add_argument("--model", default="Luyu/co-condenser-marco")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--n_neg", type=int, default=7)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--q_len", type=int, default=32)
    ap.add_argument("--p_len", type=int, default=128)
    ap.add_argument("--mine_depth", type=int, default=200)
    ap.add_argument("--mine_skip", type=int, default=30)
    ap.add_argument("--encode_bs", type=int, default=1024)
    return ap.parse_args()


def read_pairs(path):
    d = {}
    with open(path) as f:
        for line in f:
            a, b = line.rstrip("\n").split("\t")[:2]
            d[a] = b
    return d


def read_qrels(path):
    q = defaultdict(set)
    with open(path) as f:
        for line in f:
            qid, _, pid, _ = line.split()
            q[qid].add(pid)
    return q


def read_negs(path):
    negs = {}
    with open(path) as f:
        for line in f:
            qid, pids = line.rstrip("\n").split("\t")
            negs[qid] = pids.split(",")
    return negs


class NegDataset(Dataset):
    def __init__(self, queries, qrels, negs, collection, n_neg):
        self.qids = sorted(q for q in negs if q in qrels and q in queries and negs[q])
        self.queries, self.qrels, self.negs, self.coll, self.n_neg = queries, qrels, negs, collection, n_neg

    def __len__(self):
        return len(self.qids)

    def __getitem__(self, i):
        qid = self.qids[i]
        pos = random.choice(sorted(self.qrels[qid]))
        pool = self.negs[qid]
        negs = random.sample(pool, self.n_neg) if len(pool) >= self.n_neg else random.choices(pool, k=self.n_neg)
        return self.queries[qid], [self.coll[p] for p in [pos] + negs]


class Retriever(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, ids, mask):
        return self.lm(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]

    def forward(self, qi, qm, pi, pm):
        return self.encode(qi, qm), self.encode(pi, pm)


def gather_keep_local(x):
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    out[dist.get_rank()] = x
    return torch.cat(out)


@torch.no_grad()
def encode_texts(model, tok, texts, max_len, bs, device):
    out = np.zeros((len(texts), model.lm.config.hidden_size), dtype=np.float32)
    for s in range(0, len(texts), bs):
        t = tok(texts[s:s + bs], max_length=max_len, truncation=True, padding=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out[s:s + bs] = model.encode(t["input_ids"], t["attention_mask"]).float().cpu().numpy()
    return out


def refresh_negatives(model, tok, args, collection, queries, qrels, out_path, device):
    model.eval()
    pids = list(collection)
    t0 = time.time()
    p_emb = encode_texts(model, tok, [collection[p] for p in pids], args.p_len, args.encode_bs, device)
    log.info("encoded %d passages in %.0fs", len(pids), time.time() - t0)
    index = faiss.IndexFlatIP(p_emb.shape[1])
    index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), torch.cuda.current_device(), index)
    index.add(p_emb)
    del p_emb

    qids = [q for q in qrels if q in queries]
    with open(out_path + ".tmp", "w") as f:
        for s in range(0, len(qids), 4096):
            chunk = qids[s:s + 4096]
            q_emb = encode_texts(model, tok, [queries[q] for q in chunk], args.q_len, args.encode_bs, device)
            _, I = index.search(q_emb, args.mine_depth)
            for qid, row in zip(chunk, I):
                negs = [pids[j] for j in row[args.mine_skip:] if pids[j] not in qrels[qid]]
                f.write(f"{qid}\t{','.join(negs)}\n")
    os.replace(out_path + ".tmp", out_path)
    log.info("mined negatives for %d queries in %.0fs", len(qids), time.time() - t0)
    model.train()


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(message)s")
    random.seed(42 + rank)
    torch.manual_seed(42)

    collection = read_pairs(args.collection)
    queries = read_pairs(args.train_queries)
    qrels = read_qrels(args.train_qrels)
    tok = AutoTokenizer.from_pretrained(args.model)

    def collate(batch):
        q = tok([b[0] for b in batch], max_length=args.q_len, truncation=True, padding=True, return_tensors="pt")
        p = tok([x for b in batch for x in b[1]], max_length=args.p_len, truncation=True, padding=True,
                return_tensors="pt")
        return q["input_ids"], q["attention_mask"], p["input_ids"], p["attention_mask"]

    model = DDP(Retriever(args.model).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    group = 1 + args.n_neg
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    negs_path = args.bm25_negs
    sched = None
    for rnd in range(args.rounds):
        ds = NegDataset(queries, qrels, read_negs(negs_path), collection, args.n_neg)
        sampler = DistributedSampler(ds, shuffle=True, seed=rnd, drop_last=True)
        sampler.set_epoch(rnd)
        dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)
        if sched is None:
            total = len(dl) * args.rounds
            sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
        log.info("round %d: %d queries, negatives from %s", rnd, len(ds), negs_path)

        model.train()
        for it, (qi, qm, pi, pm) in enumerate(dl):
            qi, qm, pi, pm = qi.to(device), qm.to(device), pi.to(device), pm.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                q, p = model(qi, qm, pi, pm)
            q, p = gather_keep_local(q.float()), gather_keep_local(p.float())
            loss = F.cross_entropy(q @ p.t(), torch.arange(q.size(0), device=device) * group) * world
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if it % 200 == 0:
                log.info("round %d it %d/%d loss %.4f", rnd, it, len(dl), loss.item() / world)

        round_dir = os.path.join(args.work_dir, f"round{rnd}")
        if rank == 0:
            model.module.lm.save_pretrained(round_dir)
            tok.save_pretrained(round_dir)
            if rnd + 1 < args.rounds:
                refresh_negatives(model.module, tok, args, collection, queries, qrels,
                                  os.path.join(round_dir, "negs.tsv"), device)
        dist.barrier()
        negs_path = os.path.join(round_dir, "negs.tsv")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
