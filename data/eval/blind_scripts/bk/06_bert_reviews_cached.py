#!/usr/bin/env python
"""Fine-tune a BERT-style encoder for review sentiment (5 classes) with manual
data parallelism: parameters broadcast from rank 0 at start-up, gradients
averaged with bucketed all_reduce after every backward.

Tokenised tensors are cached next to the CSVs so that later runs skip the
tokenizer.

Launch:
    torchrun --nproc_per_node=8 06_bert_reviews_cached.py \
        --train data/reviews_train.csv --valid data/reviews_valid.csv
"""
import argparse
import hashlib
import logging
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("reviews")

BUCKET_MB = 25


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup-ratio", type=float, default=0.06)
    ap.add_argument("--output-dir", default="out/bert_reviews")
    ap.add_argument("--cache-dir", default=None, help="defaults to the folder of --train")
    return ap.parse_args()


def cache_path(csv_path, model_name, max_len, cache_dir):
    key = hashlib.md5(f"{os.path.abspath(csv_path)}|{model_name}|{max_len}".encode()).hexdigest()[:10]
    base = cache_dir or os.path.dirname(os.path.abspath(csv_path))
    return os.path.join(base, f".{os.path.basename(csv_path)}.{key}.pt")


def load_split(csv_path, tokenizer, args):
    path = cache_path(csv_path, args.model, args.max_len, args.cache_dir)
    if os.path.exists(path):
        enc = torch.load(path)
    else:
        df = pd.read_csv(csv_path)
        df = df.dropna(subset=["text", "stars"])
        tok = tokenizer(df["text"].tolist(), max_length=args.max_len, truncation=True,
                        padding="max_length", return_tensors="pt")
        enc = {"input_ids": tok["input_ids"], "attention_mask": tok["attention_mask"],
               "labels": torch.tensor(df["stars"].astype(int).values - 1)}
        torch.save(enc, path)
    return TensorDataset(enc["input_ids"], enc["attention_mask"], enc["labels"])


def make_buckets(params, bucket_bytes):
    buckets, cur, size = [], [], 0
    for p in params:
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


@torch.no_grad()
def allreduce_bucketed(buckets, world_size):
    for bucket in buckets:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for p, g in zip(bucket, grads):
            n = g.numel()
            if p.grad is None:
                p.grad = flat[offset:offset + n].view_as(p).clone()
            else:
                p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(3, device=device)
    for ids, mask, labels in loader:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        t[0] += out.loss * labels.size(0)
        t[1] += (out.logits.argmax(-1) == labels).sum()
        t[2] += labels.size(0)
    dist.all_reduce(t)
    return (t[0] / t[2]).item(), (t[1] / t[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = load_split(args.train, tokenizer, args)
    valid_ds = load_split(args.valid, tokenizer, args)
    logger.info("train=%d valid=%d world=%d", len(train_ds), len(valid_ds), world)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=13)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=2, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, batch_size=128,
                          sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True),
                          num_workers=2, pin_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=5).to(device)
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)  # classifier head is randomly initialised per process
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = make_buckets(list(reversed(params)), BUCKET_MB * 1024 * 1024)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (ids, mask, labels) in enumerate(train_dl):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            allreduce_bucketed(buckets, world)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 200 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_dl),
                            loss.item(), scheduler.get_last_lr()[0])

        val_loss, val_acc = evaluate(model, valid_dl, device)
        logger.info("epoch %d val_loss %.4f val_acc %.4f (%.0fs)", epoch, val_loss, val_acc, time.time() - t0)
        if rank == 0 and val_acc > best_acc:
            best_acc = val_acc
            model.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
