"""FSDP fine-tuning of a large multilingual cross-encoder for product reranking.

bge-reranker-large (XLM-R large) with long product descriptions does not fit
comfortably with plain DDP at the group sizes we want, so parameters, grads and
optimizer state are sharded with FSDP (FULL_SHARD, bf16 compute).

    torchrun --nproc_per_node=8 13_fsdp_crossenc_large.py \
        --train /shared/rerank/ml_v4/train.jsonl --dev /shared/rerank/ml_v4/dev.jsonl \
        --out /shared/ckpt/ce_large_ml_v4
"""
import argparse
import functools
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="BAAI/bge-reranker-large")
    p.add_argument("--init_from", default="", help="full state dict from a previous run (warm start)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--groups_per_gpu", type=int, default=4)
    p.add_argument("--max_len", type=int, default=384)
    p.add_argument("--lr", type=float, default=6e-6)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval_bs", type=int, default=64)
    return p.parse_args()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


class TrainGroups(Dataset):
    def __init__(self, rows, group):
        self.rows = [r for r in rows if r["pos"] and r["neg"]]
        self.group = group

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        negs = random.sample(r["neg"], self.group - 1) if len(r["neg"]) >= self.group - 1 \
            else random.choices(r["neg"], k=self.group - 1)
        return r["query"], [random.choice(r["pos"])] + negs


class DevPairs(Dataset):
    """Flattened (query, candidate) pairs; each keeps its (qid, candidate index) key."""

    def __init__(self, rows):
        self.items = [(r["qid"], j, r["query"], c["text"]) for r in rows for j, c in enumerate(r["candidates"])]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def dev_collate(batch):
    qids, idx, queries, texts = zip(*batch)
    return list(qids), torch.tensor(idx), list(queries), list(texts)


def ndcg10(scores, grades):
    order = np.argsort(-np.asarray(scores))
    g = np.asarray(grades, dtype=np.float64)
    disc = 1.0 / np.log2(np.arange(2, 12))
    dcg = ((2 ** g[order][:10] - 1) * disc[: min(10, len(g))]).sum()
    ideal = np.sort(g)[::-1][:10]
    idcg = ((2 ** ideal - 1) * disc[: len(ideal)]).sum()
    return dcg / idcg if idcg > 0 else None


@torch.no_grad()
def evaluate(model, tok, dev_rows, dev_loader, device, rank, world, max_len):
    # every rank runs the same number of forward passes (the sampler pads), which FSDP needs
    model.eval()
    local = {}
    for qids, idx, queries, texts in dev_loader:
        enc = tok(list(queries), list(texts), truncation="only_second", max_length=max_len,
                  padding=True, return_tensors="pt").to(device)
        s = model(**enc).logits.squeeze(-1).float().cpu().tolist()
        for q, j, v in zip(qids, idx.tolist(), s):
            local[(q, j)] = v
    parts = [None] * world
    dist.all_gather_object(parts, local)
    result = [None]
    if rank == 0:
        merged = {}
        for part in parts:
            merged.update(part)  # padded duplicates collapse onto the same key
        vals = []
        for r in dev_rows:
            scores = [merged[(r["qid"], j)] for j in range(len(r["candidates"]))]
            v = ndcg10(scores, [c["grade"] for c in r["candidates"]])
            if v is not None:
                vals.append(v)
        result = [float(np.mean(vals))]
    dist.broadcast_object_list(result, src=0)
    model.train()
    return result[0]


def save_full(model, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()  # collective: all ranks must enter
    if rank == 0:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu"))
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={XLMRobertaLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        limit_all_gathers=True,
        use_orig_params=True,
    )

    train_ds = TrainGroups(read_jsonl(args.train), args.group)
    dev_rows = read_jsonl(args.dev)
    dev_ds = DevPairs(dev_rows)

    def collate(batch):
        qs, docs = zip(*batch)
        return tok([q for q, d in zip(qs, docs) for _ in d], [x for d in docs for x in d],
                   truncation="only_second", max_length=args.max_len, padding=True, return_tensors="pt")

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.groups_per_gpu, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    dev_dl = DataLoader(dev_ds, batch_size=args.eval_bs, sampler=dev_sampler, num_workers=2,
                        collate_fn=dev_collate)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.05 * total), total)
    if rank == 0:
        print(f"train groups {len(train_ds):,}  dev queries {len(dev_rows):,}  steps {total}", flush=True)
        os.makedirs(args.out, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = batch.to(device)
            logits = model(**batch).logits.float().view(-1, args.group)
            loss = F.cross_entropy(logits, torch.zeros(logits.size(0), dtype=torch.long, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (step + 1):.2f}s/step", flush=True)

        ndcg = evaluate(model, tok, dev_rows, dev_dl, device, rank, world, args.max_len)
        if rank == 0:
            print(f"epoch {epoch} dev nDCG@10 {ndcg:.4f}", flush=True)
        save_full(model, os.path.join(args.out, f"epoch{epoch}.pt"), rank)
        if ndcg > best:
            best = ndcg
            save_full(model, os.path.join(args.out, "best.pt"), rank)

    if rank == 0:
        tok.save_pretrained(args.out)
        print(f"best dev nDCG@10 {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
