"""XBRL numeric entity tagging (FiNER-139) with SEC-BERT.

    torchrun --nproc_per_node=4 07_finer_xbrl_tagging.py --output_dir runs/finer_secbert
"""
import argparse
import json
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger("finer")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="nlpaueb/sec-bert-num")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--train_batch_size", type=int, default=16)
    ap.add_argument("--eval_batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.05)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class UnpaddedShardSampler(Sampler):
    def __init__(self, num_samples, rank, world_size):
        self.indices = list(range(rank, num_samples, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def tokenize_and_align(examples, tokenizer, max_length):
    enc = tokenizer(examples["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
    all_labels = []
    for i, tags in enumerate(examples["ner_tags"]):
        prev, row = None, []
        for wid in enc.word_ids(i):
            row.append(-100 if wid is None or wid == prev else tags[wid])
            prev = wid
        all_labels.append(row)
    enc["labels"] = all_labels
    return enc


def extract_spans(tag_ids, id2label):
    spans, start, cur = [], None, None
    for i, t in enumerate(list(tag_ids) + [0]):
        name = id2label[t]
        if name == "O" or name.startswith("B-"):
            if cur is not None:
                spans.append((start, i, cur))
                cur = None
            if name.startswith("B-"):
                start, cur = i, name[2:]
        elif cur is None or name[2:] != cur:
            if cur is not None:
                spans.append((start, i, cur))
            start, cur = i, name[2:]
    return set(spans)


@torch.no_grad()
def evaluate(model, loader, device, id2label):
    model.eval()
    tp = fp = fn = 0
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       token_type_ids=batch.get("token_type_ids")).logits
        preds = logits.argmax(-1)
        for p, g in zip(preds.tolist(), batch["labels"].tolist()):
            keep = [j for j, y in enumerate(g) if y != -100]
            ps = extract_spans([p[j] for j in keep], id2label)
            gs = extract_spans([g[j] for j in keep], id2label)
            tp += len(ps & gs)
            fp += len(ps - gs)
            fn += len(gs - ps)
    counts = torch.tensor([tp, fp, fn], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    tp, fp, fn = counts.tolist()
    precision = tp / max(tp + fp, 1.0)
    recall = tp / max(tp + fn, 1.0)
    model.train()
    return {"precision": precision, "recall": recall,
            "micro_f1": 2 * precision * recall / max(precision + recall, 1e-12)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")
    seed_all(args.seed)

    raw = load_dataset("nlpaueb/finer-139")
    label_names = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)

    # let rank 0 fill the datasets cache first, the others then read it
    if rank != 0:
        dist.barrier()
    tokenized = raw.map(tokenize_and_align, batched=True, remove_columns=raw["train"].column_names,
                        fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length})
    if rank == 0:
        dist.barrier()

    collator = DataCollatorForTokenClassification(tokenizer)
    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=args.seed)
    train_loader = DataLoader(tokenized["train"], batch_size=args.train_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(tokenized["validation"], batch_size=args.eval_batch_size,
                            sampler=UnpaddedShardSampler(len(tokenized["validation"]), rank, world_size),
                            collate_fn=collator, num_workers=4)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(label_names), id2label=id2label,
        label2id={v: k for k, v in id2label.items()})
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best, global_step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f %.2f it/s", epoch, global_step, loss.item(),
                            100 / (time.time() - t0))
                t0 = time.time()

            if global_step % args.eval_every == 0:
                metrics = evaluate(model.module, dev_loader, device, id2label)
                logger.info("step %d dev %s", global_step, json.dumps(metrics))
                if rank == 0 and metrics["micro_f1"] > best:
                    best = metrics["micro_f1"]
                    model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                    tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
                dist.barrier()

    if rank == 0:
        with open(os.path.join(args.output_dir, "best_dev.json"), "w") as f:
            json.dump({"micro_f1": best}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
