#!/usr/bin/env python
"""
Fast SQuAD baseline: distilroberta-base, DDP, evaluation split across GPUs.

    torchrun --nproc_per_node=8 20_qa_squad_distilroberta.py --output_dir runs/distilroberta-squad
"""
import argparse
import collections
import json
import logging
import os
import re
import string
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, get_linear_schedule_with_warmup

logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="distilroberta-base")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_len", type=int, default=384)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--n_best", type=int, default=20)
    ap.add_argument("--max_answer_len", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def train_features(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second", max_length=a.max_len,
              stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    sp, ep = [], []
    for i, offs in enumerate(enc.pop("offset_mapping")):
        seq = enc.sequence_ids(i)
        ans = ex["answers"][smap[i]]
        sc = ans["answer_start"][0]
        ec = sc + len(ans["text"][0])
        ctx = [k for k, s in enumerate(seq) if s == 1]
        if offs[ctx[0]][0] > sc or offs[ctx[-1]][1] < ec:
            sp.append(0)
            ep.append(0)
        else:
            sp.append(next(k for k in ctx if offs[k][1] > sc))
            ep.append(next(k for k in reversed(ctx) if offs[k][0] < ec))
    enc["start_positions"], enc["end_positions"] = sp, ep
    return enc


def eval_features(ex, tok, a):
    enc = tok([q.lstrip() for q in ex["question"]], ex["context"], truncation="only_second", max_length=a.max_len,
              stride=a.stride, return_overflowing_tokens=True, return_offsets_mapping=True)
    smap = enc.pop("overflow_to_sample_mapping")
    enc["example_id"] = [ex["id"][j] for j in smap]
    enc["offset_mapping"] = [[o if s == 1 else None for o, s in zip(offs, enc.sequence_ids(i))]
                             for i, offs in enumerate(enc["offset_mapping"])]
    return enc


def normalize(s):
    s = "".join(c for c in s.lower() if c not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1(pred, gold):
    p, g = normalize(pred).split(), normalize(gold).split()
    same = sum((collections.Counter(p) & collections.Counter(g)).values())
    if not same:
        return 0.0
    return 2 * same / (len(p) + len(g))


@torch.no_grad()
def evaluate_shard(model, examples, features, loader, device, a):
    """Predict and score this rank's share of the dev examples."""
    model.eval()
    starts, ends = [], []
    for batch in loader:
        n = batch["attention_mask"].sum(1).tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        s, e = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        starts.extend(s[j, :n[j]] for j in range(len(n)))
        ends.extend(e[j, :n[j]] for j in range(len(n)))
    model.train()

    groups = collections.defaultdict(list)
    for i, eid in enumerate(features["example_id"]):
        groups[eid].append(i)
    em_total = f1_total = 0.0
    for ex in examples:
        best, best_score = "", -np.inf
        for fi in groups[ex["id"]]:
            offs = features[fi]["offset_mapping"]
            for s in np.argsort(starts[fi])[::-1][: a.n_best]:
                for e in np.argsort(ends[fi])[::-1][: a.n_best]:
                    if s >= len(offs) or e >= len(offs) or offs[s] is None or offs[e] is None:
                        continue
                    if e < s or e - s + 1 > a.max_answer_len:
                        continue
                    sc = starts[fi][s] + ends[fi][e]
                    if sc > best_score:
                        best_score, best = sc, ex["context"][offs[s][0]:offs[e][1]]
        golds = ex["answers"]["text"]
        em_total += max(float(normalize(best) == normalize(g)) for g in golds)
        f1_total += max(f1(best, g) for g in golds)
    n_ex = len(examples)
    return {"exact_match": 100.0 * em_total / n_ex, "f1": 100.0 * f1_total / n_ex, "n": n_ex}


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(a.seed)

    tok = AutoTokenizer.from_pretrained(a.model)
    squad = load_dataset("squad")
    # each rank scores a contiguous slice of the dev questions
    dev_examples = squad["validation"].shard(num_shards=world, index=rank, contiguous=True)

    if rank != 0:
        dist.barrier()
    train = squad["train"].map(train_features, batched=True, fn_kwargs={"tok": tok, "a": a},
                               remove_columns=squad["train"].column_names, num_proc=8)
    if rank == 0:
        dist.barrier()
    dev_feats = dev_examples.map(eval_features, batched=True, fn_kwargs={"tok": tok, "a": a},
                                 remove_columns=dev_examples.column_names, load_from_cache_file=False,
                                 keep_in_memory=True)
    dev_inputs = dev_feats.remove_columns(["example_id", "offset_mapping"])

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    sampler = DistributedSampler(train, shuffle=True, seed=a.seed)
    train_dl = DataLoader(train, batch_size=a.batch_size, sampler=sampler, collate_fn=collator,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_inputs, batch_size=128, shuffle=False, collate_fn=collator)

    model = AutoModelForQuestionAnswering.from_pretrained(a.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    total = a.epochs * len(train_dl)
    sched = get_linear_schedule_with_warmup(opt, int(a.warmup * total), total)

    best_f1 = -1.0
    history = []
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        # DDP wrapper is not needed for inference; run the bare module on this rank's slice
        metrics = evaluate_shard(model.module, dev_examples, dev_feats, dev_dl, device, a)
        if rank == 0:
            logger.info("epoch %d (%.0fs): dev EM %.2f F1 %.2f", epoch, time.time() - t0,
                        metrics["exact_match"], metrics["f1"])
            history.append({"epoch": epoch, **metrics})
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                model.module.save_pretrained(a.output_dir)
                tok.save_pretrained(a.output_dir)
                with open(os.path.join(a.output_dir, "dev_metrics.json"), "w") as f:
                    json.dump(history, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
