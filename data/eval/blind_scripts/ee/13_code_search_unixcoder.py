"""NL -> code retrieval (CodeSearchNet, one language) with UniXcoder as a shared encoder.

Hard negatives: functions with the highest BM25 score against the docstring that are not
the gold function (pre-mined, see mine_negatives.py). Eval: each docstring against the
whole test code pool (MRR over the full pool, as in the UniXcoder paper) + R@{1,5,10}.

  torchrun --nproc_per_node=8 13_code_search_unixcoder.py --lang python --data_dir data/csn
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lang", default="python")
    ap.add_argument("--data_dir", default="data/csn")
    ap.add_argument("--model", default="microsoft/unixcoder-base")
    ap.add_argument("--output_dir", default="saved_models/csn")
    ap.add_argument("--nl_len", type=int, default=128)
    ap.add_argument("--code_len", type=int, default=256)
    ap.add_argument("--train_batch_size", type=int, default=32)
    ap.add_argument("--eval_batch_size", type=int, default=256)
    ap.add_argument("--hard_negatives", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=123456)
    return ap.parse_args()


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


class CodeSearchTrain(Dataset):
    def __init__(self, rows, n_hard):
        self.rows = rows
        self.by_url = {r["url"]: r for r in rows}
        self.n_hard = n_hard

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        cands = [u for u in r.get("bm25_negatives", []) if u in self.by_url]
        if len(cands) < self.n_hard:
            cands = cands + random.sample(self.rows, self.n_hard)[: self.n_hard - len(cands)]
            cands = [c if isinstance(c, str) else c["url"] for c in cands]
        negs = random.sample(cands, self.n_hard)
        codes = [r["code"]] + [self.by_url[u]["code"] for u in negs]
        return r["docstring"], codes


class UniXcoderEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def forward(self, ids):
        mask = ids.ne(1)  # pad id of the RoBERTa vocab
        out = self.encoder(ids, attention_mask=mask.long()).last_hidden_state
        emb = (out * mask.unsqueeze(-1)).sum(1) / mask.sum(-1, keepdim=True)
        return F.normalize(emb, p=2, dim=1)


class PairModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.enc = UniXcoderEncoder(name)

    def forward(self, nl_ids, code_ids):
        return self.enc(nl_ids), self.enc(code_ids)


def unix_tokenize(tok, texts, max_len):
    # <s> <encoder-only> </s> tokens </s>, padded to max_len (UniXcoder convention)
    out = []
    for t in texts:
        toks = tok.tokenize(t)[: max_len - 4]
        toks = [tok.cls_token, "<encoder-only>", tok.sep_token] + toks + [tok.sep_token]
        ids = tok.convert_tokens_to_ids(toks)
        out.append(ids + [tok.pad_token_id] * (max_len - len(ids)))
    return torch.tensor(out, dtype=torch.long)


def gather_local_grad(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    parts[dist.get_rank()] = x
    return torch.cat(parts, dim=0)


@torch.no_grad()
def evaluate(encoder, tok, test_rows, args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    encoder.eval()
    code_vecs = []
    for i in range(0, len(test_rows), args.eval_batch_size):
        ids = unix_tokenize(tok, [r["code"] for r in test_rows[i:i + args.eval_batch_size]], args.code_len)
        code_vecs.append(encoder(ids.to(device)))
    code_vecs = torch.cat(code_vecs)

    idx = list(range(rank, len(test_rows), world))
    rr_sum, r1, r5, r10 = 0.0, 0.0, 0.0, 0.0
    for s in range(0, len(idx), args.eval_batch_size):
        chunk = idx[s:s + args.eval_batch_size]
        nl = unix_tokenize(tok, [test_rows[i]["docstring"] for i in chunk], args.nl_len).to(device)
        scores = encoder(nl) @ code_vecs.t()
        gold = torch.tensor(chunk, device=device)
        gold_score = scores.gather(1, gold.unsqueeze(1))
        ranks = (scores > gold_score).sum(1) + 1
        rr_sum += (1.0 / ranks.float()).sum().item()
        r1 += (ranks <= 1).sum().item()
        r5 += (ranks <= 5).sum().item()
        r10 += (ranks <= 10).sum().item()

    totals = torch.tensor([rr_sum, r1, r5, r10, float(len(idx))], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    encoder.train()
    n = totals[4].item()
    return {"MRR": totals[0].item() / n, "R@1": totals[1].item() / n, "R@5": totals[2].item() / n,
            "R@10": totals[3].item() / n}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    lang_dir = os.path.join(args.data_dir, args.lang)
    train_rows = load_jsonl(os.path.join(lang_dir, "train_with_bm25_negs.jsonl"))
    valid_rows = load_jsonl(os.path.join(lang_dir, "valid.jsonl"))
    tok = AutoTokenizer.from_pretrained(args.model)

    def collate(batch):
        nl = unix_tokenize(tok, [b[0] for b in batch], args.nl_len)
        code = unix_tokenize(tok, [c for b in batch for c in b[1]], args.code_len)
        return nl, code

    ds = CodeSearchTrain(train_rows, args.hard_negatives)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, sampler=sampler, batch_size=args.train_batch_size, collate_fn=collate, num_workers=4,
                    drop_last=True)

    model = DDP(PairModel(args.model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    total = len(dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, total)
    group = 1 + args.hard_negatives

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("lang=%s train=%d valid=%d total_steps=%d", args.lang, len(ds), len(valid_rows), total)

    best_mrr = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for step, (nl, code) in enumerate(dl, 1):
            nl, code = nl.to(device), code.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                nl_vec, code_vec = model(nl, code)
            nl_vec, code_vec = gather_local_grad(nl_vec.float()), gather_local_grad(code_vec.float())
            logits = args.scale * nl_vec @ code_vec.t()
            loss = F.cross_entropy(logits, torch.arange(nl_vec.size(0), device=device) * group) * world
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            running += loss.item() / world
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f (%.1fs)", epoch, step, running / 100, time.time() - t0)
                running = 0.0

        res = evaluate(model.module.enc, tok, valid_rows, args, device)
        logger.info("epoch %d valid %s", epoch, res)
        if rank == 0 and res["MRR"] > best_mrr:
            best_mrr = res["MRR"]
            out = os.path.join(args.output_dir, args.lang, "checkpoint-best-mrr")
            os.makedirs(out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(out, "model.bin"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
