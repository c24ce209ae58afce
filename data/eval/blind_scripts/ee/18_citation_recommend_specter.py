"""Citation recommendation: paper (title+abstract) -> papers it should cite.

SPECTER-initialised bi-encoder; positives are cited papers, hard negatives are papers
cited by the citations but not by the query paper ("citation of citation").
Model selection on the validation papers, final numbers on the test papers
(MAP and Recall@{20,100} against the candidate pool, FAISS exact search).

  torchrun --nproc_per_node=4 18_citation_recommend_specter.py --data data/citrec --out runs/citrec
"""
import argparse
import json
import logging
import os
import random

import faiss
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("citrec")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="allenai/specter2_base")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hard", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def load_papers(path):
    papers = {}
    with open(path) as f:
        for line in f:
            p = json.loads(line)
            papers[p["paper_id"]] = (p["title"] or "", p.get("abstract") or "")
    return papers


class CitationTriples(Dataset):
    def __init__(self, rows, papers, hard):
        self.rows = [r for r in rows if r["cited"] and r["cited_of_cited"]]
        self.papers, self.hard = papers, hard

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pos = random.choice(r["cited"])
        pool = r["cited_of_cited"]
        negs = random.sample(pool, self.hard) if len(pool) >= self.hard else random.choices(pool, k=self.hard)
        return self.papers[r["paper_id"]], [self.papers[p] for p in [pos] + negs]


class PaperEncoder(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.bert = AutoModel.from_pretrained(base, add_pooling_layer=False)

    def embed(self, enc):
        return self.bert(**enc).last_hidden_state[:, 0]

    def forward(self, q, d):
        return self.embed(q), self.embed(d)


def tokenize_papers(tok, papers, max_len):
    return tok([t for t, _ in papers], [a for _, a in papers], max_length=max_len, truncation="only_second",
               padding=True, return_tensors="pt")


def gather_with_grad(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    parts[dist.get_rank()] = x
    return torch.cat(parts)


@torch.no_grad()
def embed_papers(model, tok, ids, papers, max_len, device, bs=128):
    out = []
    for s in range(0, len(ids), bs):
        enc = tokenize_papers(tok, [papers[i] for i in ids[s:s + bs]], max_len).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(model.embed(enc).float().cpu())
    return torch.cat(out).numpy() if out else np.zeros((0, 768), "float32")


def evaluate(model, tok, split_rows, pool_ids, papers, args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    mine = pool_ids[rank::world]
    parts = [None] * world
    dist.all_gather_object(parts, (mine, embed_papers(model, tok, mine, papers, args.max_len, device)))
    index = faiss.IndexFlatIP(parts[0][1].shape[1])
    index.add(np.concatenate([p[1] for p in parts]).astype("float32"))
    order = [i for p in parts for i in p[0]]

    my_rows = split_rows[rank::world]
    stats = torch.zeros(4, dtype=torch.float64, device=device)  # AP, R@20, R@100, n
    if my_rows:
        q = embed_papers(model, tok, [r["paper_id"] for r in my_rows], papers, args.max_len, device)
        _, I = index.search(q, 101)
        for r, row in zip(my_rows, I):
            gold = set(r["cited"])
            ranked = [order[j] for j in row if order[j] != r["paper_id"]][:100]
            hits, ap = 0, 0.0
            for k, pid in enumerate(ranked):
                if pid in gold:
                    hits += 1
                    ap += hits / (k + 1)
            stats[0] += ap / len(gold)
            stats[1] += len(gold & set(ranked[:20])) / len(gold)
            stats[2] += len(gold & set(ranked)) / len(gold)
            stats[3] += 1
    dist.all_reduce(stats)
    model.train()
    n = stats[3].item()
    return {"MAP": stats[0].item() / n, "R@20": stats[1].item() / n, "R@100": stats[2].item() / n}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    papers = load_papers(os.path.join(args.data, "papers.jsonl"))
    splits = {s: [json.loads(l) for l in open(os.path.join(args.data, f"{s}.jsonl"))]
              for s in ("train", "valid", "test")}
    pool_ids = sorted(json.load(open(os.path.join(args.data, "candidate_pool.json"))))
    tok = AutoTokenizer.from_pretrained(args.base)

    def collate(batch):
        q = tokenize_papers(tok, [b[0] for b in batch], args.max_len)
        d = tokenize_papers(tok, [p for b in batch for p in b[1]], args.max_len)
        return q, d

    ds = CitationTriples(splits["train"], papers, args.hard)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, collate_fn=collate, num_workers=4, drop_last=True)

    model = DDP(PaperEncoder(args.base).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    group = 1 + args.hard
    best_path = os.path.join(args.out, "best_model.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_map = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (q, d) in enumerate(dl):
            q, d = q.to(device), d.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                qv, dv = model(q, d)
            qv, dv = gather_with_grad(qv.float()), gather_with_grad(dv.float())
            logits = F.normalize(qv, dim=-1) @ F.normalize(dv, dim=-1).t() / args.tau
            loss = F.cross_entropy(logits, torch.arange(qv.size(0), device=device) * group) * world
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(dl), loss.item() / world)

        val = evaluate(model.module, tok, splits["valid"], pool_ids, papers, args, device)
        logger.info("epoch %d valid %s", epoch, val)
        if rank == 0 and val["MAP"] > best_map:
            best_map = val["MAP"]
            torch.save(model.state_dict(), best_path)
            logger.info("new best (MAP %.4f) -> %s", best_map, best_path)
        dist.barrier()

    # final test numbers with the best validation checkpoint
    best = PaperEncoder(args.base)
    best.load_state_dict(torch.load(best_path, map_location="cpu"))
    best.to(device)
    test = evaluate(best, tok, splits["test"], pool_ids, papers, args, device)
    if rank == 0:
        logger.info("test (best valid MAP %.4f): %s", best_map, test)
        with open(os.path.join(args.out, "test_metrics.json"), "w") as f:
            json.dump({"valid_MAP": best_map, **test}, f, indent=2)
        best.bert.save_pretrained(os.path.join(args.out, "best_hf"))
        tok.save_pretrained(os.path.join(args.out, "best_hf"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
