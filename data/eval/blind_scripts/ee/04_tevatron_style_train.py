"""coCondenser -> MS MARCO dense retriever, Tevatron-style training loop.

  torchrun --nproc_per_node=4 04_tevatron_style_train.py \
      --model_name_or_path Luyu/co-condenser-marco --train_path data/marco_hn.jsonl \
      --dev_run runs/bm25.dev.top1000.tsv --output_dir ckpt/cocondenser-hn
"""
import json
import logging
import math
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, HfArgumentParser, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


@dataclass
class Args:
    model_name_or_path: str = "Luyu/co-condenser-marco"
    train_path: str = "data/marco_hn.jsonl"
    corpus_path: str = "data/corpus.jsonl"
    dev_queries: str = "data/dev.queries.tsv"
    dev_qrels: str = "data/qrels.dev.tsv"
    dev_run: str = "runs/bm25.dev.top1000.tsv"
    output_dir: str = "ckpt/cocondenser-hn"
    train_n_passages: int = 8
    per_device_train_batch_size: int = 8
    q_max_len: int = 32
    p_max_len: int = 128
    learning_rate: float = 5e-6
    num_train_epochs: int = 3
    warmup_ratio: float = 0.1
    temperature: float = 1.0
    bf16: bool = True
    seed: int = 42
    logging_steps: int = 50
    eval_queries: Optional[int] = field(default=None, metadata={"help": "limit dev queries"})


def load_corpus(path):
    corpus = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            corpus[d["docid"]] = (d.get("title", ""), d["text"])
    return corpus


class TrainGroups(Dataset):
    def __init__(self, path, corpus, n_passages):
        self.groups = [json.loads(l) for l in open(path)]
        self.corpus = corpus
        self.n_passages = n_passages
        self.epoch = 0

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, idx):
        g = self.groups[idx]
        rnd = random.Random(idx + 7919 * self.epoch)
        pos = rnd.choice(g["positives"])
        negs = list(g["negatives"])
        rnd.shuffle(negs)
        negs = negs[: self.n_passages - 1]
        return g["query"], [self.corpus[p] for p in [pos] + negs]


@dataclass
class GroupCollator:
    tokenizer: AutoTokenizer
    q_max_len: int
    p_max_len: int

    def __call__(self, features):
        queries = [f[0] for f in features]
        psgs, sizes = [], []
        for _, group in features:
            psgs.extend(group)
            sizes.append(len(group))
        q = self.tokenizer(queries, max_length=self.q_max_len, truncation=True, padding=True, return_tensors="pt")
        p = self.tokenizer([t for t, _ in psgs], [x for _, x in psgs], max_length=self.p_max_len,
                           truncation="only_second", padding=True, return_tensors="pt")
        return q, p, torch.tensor(sizes)


class DenseModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModel.from_pretrained(name, add_pooling_layer=False)

    def encode(self, batch) -> Tensor:
        return self.lm(**batch, return_dict=True).last_hidden_state[:, 0]

    def forward(self, q, p):
        return self.encode(q), self.encode(p)


def dist_gather_tensor(t: Tensor) -> Tensor:
    t = t.contiguous()
    all_tensors = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(all_tensors, t)
    all_tensors[dist.get_rank()] = t
    return torch.cat(all_tensors, dim=0)


def contrastive_loss(q: Tensor, p: Tensor, group_sizes: Tensor, temperature: float) -> Tensor:
    scores = q @ p.t() / temperature
    offsets = torch.cumsum(group_sizes, 0) - group_sizes  # first passage of each group is the positive
    return F.cross_entropy(scores, offsets.to(scores.device))


@torch.no_grad()
def rerank_dev(model: DenseModel, tok, args: Args, corpus, device):
    """Re-score BM25 top-1000 with the dense model; MRR@10 summed over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    queries = dict(l.rstrip("\n").split("\t") for l in open(args.dev_queries))
    qrels = defaultdict(set)
    for l in open(args.dev_qrels):
        qid, _, pid, rel = l.split()
        if int(rel) > 0:
            qrels[qid].add(pid)
    run = defaultdict(list)
    for l in open(args.dev_run):
        qid, pid = l.split()[:2]
        run[qid].append(pid)
    qids = sorted(q for q in run if q in qrels)
    if args.eval_queries:
        qids = qids[: args.eval_queries]

    model.eval()
    rr_sum = torch.zeros(1, device=device, dtype=torch.float64)
    count = torch.zeros(1, device=device, dtype=torch.float64)
    for qid in qids[rank::world]:
        cands = run[qid]
        q = tok([queries[qid]], max_length=args.q_max_len, truncation=True, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
            q_rep = model.encode(q).float()
            p_reps = []
            for s in range(0, len(cands), 250):
                chunk = [corpus[c] for c in cands[s:s + 250]]
                p = tok([t for t, _ in chunk], [x for _, x in chunk], max_length=args.p_max_len,
                        truncation="only_second", padding=True, return_tensors="pt").to(device)
                p_reps.append(model.encode(p).float())
        scores = (q_rep @ torch.cat(p_reps).t()).squeeze(0)
        top = scores.topk(min(10, len(cands))).indices.tolist()
        for r, j in enumerate(top):
            if cands[j] in qrels[qid]:
                rr_sum += 1.0 / (r + 1)
                break
        count += 1
    dist.all_reduce(rr_sum)
    dist.all_reduce(count)
    model.train()
    return (rr_sum / count.clamp(min=1)).item()


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(name)s - %(message)s")
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name_or_path)
    corpus = load_corpus(args.corpus_path)
    train_ds = TrainGroups(args.train_path, corpus, args.train_n_passages)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, sampler=sampler,
                        collate_fn=GroupCollator(tok, args.q_max_len, args.p_max_len),
                        num_workers=4, drop_last=True, pin_memory=True)

    model = DDP(DenseModel(args.model_name_or_path).to(device), device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    num_steps = len(loader) * args.num_train_epochs
    sched = get_linear_schedule_with_warmup(optim, math.ceil(args.warmup_ratio * num_steps), num_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        logger.info("groups=%d steps=%d world=%d", len(train_ds), num_steps, world)

    global_step = 0
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        train_ds.epoch = epoch
        for q, p, sizes in loader:
            q, p = q.to(device), p.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
                q_reps, p_reps = model(q, p)
            all_sizes = dist_gather_tensor(sizes.to(device))
            q_all = dist_gather_tensor(q_reps.float())
            p_all = dist_gather_tensor(p_reps.float())
            loss = contrastive_loss(q_all, p_all, all_sizes, args.temperature) * world

            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % args.logging_steps == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, global_step, loss.item() / world)

        mrr = rerank_dev(model.module, tok, args, corpus, device)
        logger.info("epoch %d dev MRR@10 %.4f", epoch, mrr)
        if rank == 0:
            save_dir = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.lm.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
