#!/usr/bin/env python
# Fine-tune DistilBERT for news topic classification on an in-house CSV dump.
#
#   torchrun --standalone --nproc_per_node=4 03_news_topic_distilbert.py \
#       --csv data/news_2023.csv --output_dir outputs/news_topic
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--model_name", default="distilbert-base-uncased")
    ap.add_argument("--output_dir", default="outputs/news_topic")
    ap.add_argument("--max_length", type=int, default=192)
    ap.add_argument("--per_device_batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5, help="tuned for 4 GPUs x 32")
    ap.add_argument("--warmup_ratio", type=float, default=0.06)
    ap.add_argument("--val_frac", type=float, default=0.1)
    ap.add_argument("--min_class_count", type=int, default=50)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bf16", action="store_true")
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def clean(df, min_count):
    df = df.dropna(subset=["headline", "category"]).copy()
    df["category"] = df["category"].str.strip().str.upper()
    df["text"] = df["headline"].str.strip() + ". " + df["short_description"].fillna("").str.strip()
    df = df.drop_duplicates(subset=["text"])
    counts = df["category"].value_counts()
    keep = counts[counts >= min_count].index
    return df[df["category"].isin(keep)].reset_index(drop=True)


class NewsDataset(Dataset):
    def __init__(self, encodings, labels):
        self.enc = encodings
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        item = {k: torch.tensor(v[idx]) for k, v in self.enc.items()}
        item["labels"] = torch.tensor(self.labels[idx])
        return item


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    seed_everything(args.seed)

    df = clean(pd.read_csv(args.csv), args.min_class_count)
    label_names = list(set(df["category"]))
    label2id = {name: i for i, name in enumerate(label_names)}
    id2label = {i: name for name, i in label2id.items()}
    labels = df["category"].map(label2id).tolist()
    log.info("%d rows, %d classes", len(df), len(label_names))

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    enc = tokenizer(df["text"].tolist(), truncation=True, max_length=args.max_length, padding="max_length")
    full = NewsDataset(dict(enc), labels)
    n_val = int(len(full) * args.val_frac)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val],
                                    generator=torch.Generator().manual_seed(args.seed))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.per_device_batch_size * 2, sampler=val_sampler, num_workers=2)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name, num_labels=len(label_names), id2label=id2label, label2id=label2id)
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps), total_steps)
    amp_dtype = torch.bfloat16 if args.bf16 else torch.float16
    scaler = torch.cuda.amp.GradScaler(enabled=not args.bf16)

    best_acc = 0.0
    os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=amp_dtype):
                out = model(**batch)
            scaler.scale(out.loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_loader),
                         out.loss.item(), scheduler.get_last_lr()[0])

        model.eval()
        correct = torch.zeros(1, device=device)
        seen = torch.zeros(1, device=device)
        with torch.no_grad():
            for batch in val_loader:
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                with torch.autocast("cuda", dtype=amp_dtype):
                    logits = model(**batch).logits
                correct += (logits.argmax(-1) == batch["labels"]).sum()
                seen += batch["labels"].numel()
        dist.all_reduce(correct)
        dist.all_reduce(seen)
        acc = (correct / seen).item()
        log.info("epoch %d val_acc %.4f", epoch, acc)

        if rank == 0 and acc > best_acc:
            best_acc = acc
            save_dir = os.path.join(args.output_dir, "best")
            model.module.save_pretrained(save_dir)
            tokenizer.save_pretrained(save_dir)
            with open(os.path.join(save_dir, "metrics.json"), "w") as f:
                json.dump({"epoch": epoch, "val_acc": acc}, f)
        dist.barrier()

    log.info("done, best val acc %.4f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
