#!/usr/bin/env python
"""UPOS tagging on Universal Dependencies treebanks with XLM-R (token classification, DDP).

    torchrun --nproc_per_node=8 12_pos_tagging_xlmr.py --treebank en_ewt --output_dir runs/upos-en_ewt
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_linear_schedule_with_warmup,
)

logger = logging.getLogger("upos")

UPOS = ["NOUN", "PUNCT", "ADP", "NUM", "SYM", "SCONJ", "ADJ", "PART", "DET", "CCONJ",
        "PROPN", "PRON", "X", "_", "ADV", "INTJ", "VERB", "AUX"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--treebank", default="en_ewt")
    ap.add_argument("--model_name", default="xlm-roberta-large")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--per_device_batch_size", type=int, default=32)
    ap.add_argument("--learning_rate", type=float, default=2e-5)
    ap.add_argument("--num_epochs", type=int, default=10)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--eval_every", type=int, default=1, help="epochs")
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def encode(batch, tokenizer, max_length):
    enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
    labels = []
    for i, tags in enumerate(batch["upos"]):
        prev = None
        row = []
        for w in enc.word_ids(batch_index=i):
            if w is None or w == prev:
                row.append(-100)
            else:
                row.append(tags[w])
            prev = w
        labels.append(row)
    enc["labels"] = labels
    return enc


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    per_sentence = []
    for batch in loader:
        sid = batch.pop("sid").tolist()
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**batch).logits
        pred = logits.argmax(-1)
        mask = batch["labels"].ne(-100)
        correct = (pred.eq(batch["labels"]) & mask).sum(-1).tolist()
        total = mask.sum(-1).tolist()
        per_sentence.extend(zip(sid, correct, total))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, per_sentence)
    model.train()
    # DistributedSampler repeats a few sentences to give every rank the same count
    unique = {s: (c, t) for shard in shards for s, c, t in shard}
    n_correct = sum(c for c, _ in unique.values())
    n_total = sum(t for _, t in unique.values())
    return n_correct / max(n_total, 1)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    ud = load_dataset("universal_dependencies", args.treebank)

    if rank != 0:
        dist.barrier()
    encoded = ud.map(encode, batched=True, remove_columns=ud["train"].column_names,
                     fn_kwargs={"tokenizer": tokenizer, "max_length": args.max_length})
    if rank == 0:
        dist.barrier()

    train_ds = encoded["train"]
    dev_ds = encoded["validation"].add_column("sid", list(range(len(encoded["validation"]))))
    test_ds = encoded["test"].add_column("sid", list(range(len(encoded["test"]))))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=128, sampler=DistributedSampler(dev_ds, shuffle=False),
                            collate_fn=collator)
    test_loader = DataLoader(test_ds, batch_size=128, sampler=DistributedSampler(test_ds, shuffle=False),
                             collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model_name, num_labels=len(UPOS),
        id2label=dict(enumerate(UPOS)), label2id={t: i for i, t in enumerate(UPOS)},
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train_ds) / args.per_device_batch_size)
    total_steps = steps_per_epoch * args.num_epochs
    warmup_steps = int(args.warmup_ratio * total_steps)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    logger.info("%d train sentences, %d steps (%d warmup)", len(train_ds), total_steps, warmup_steps)

    best_acc = 0.0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running, n = 0.0, 0
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            running += loss.item()
            n += 1
        logger.info("epoch %d: train loss %.4f, lr %.2e, %.0fs", epoch, running / max(n, 1),
                    scheduler.get_last_lr()[0], time.time() - t0)

        if (epoch + 1) % args.eval_every == 0:
            acc = evaluate(model, dev_loader, device)
            logger.info("epoch %d: dev UPOS acc %.4f", epoch, acc)
            if acc > best_acc:
                best_acc = acc
                if rank == 0:
                    model.module.save_pretrained(args.output_dir)
                    tokenizer.save_pretrained(args.output_dir)
            dist.barrier()

    test_acc = evaluate(model, test_loader, device)
    logger.info("dev best %.4f | test (last epoch) %.4f", best_acc, test_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
